//! The strategies on N CPU ranks: ZeRO stages 1–3 against `ddp` and `single` (parity), the
//! bytes each rank holds (memory accounting), checkpoints that resume under another strategy
//! and world size, and every strategy × policy combination either training or refused.
//!
//! Parity is the largest per-tensor ‖a − b‖ / ‖b‖ over every parameter and buffer after 5
//! optimizer steps.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::prelude::*;
use kiln::builtin::train;
use kiln::run::RunOptions;
use kiln::trainer::parameter_values;

use crate::common::{max_relative_diff, small_config, temp_dir, train_bin, train_losses};
use crate::gpt::{gpt_config, text_file};

/// ZeRO against `ddp` on the same ranks: the same sums, partly in another order. Most cases
/// stay near 1e-7; with gradient accumulation the micro-batches' shards are added in another
/// order than ddp's whole gradients, and AdamW turns those last-bit differences into
/// relative ones of a few 1e-6 (1.9e-6 on the GPT at 2 ranks once its Linears run as one
/// matrix product over the batch's rows) — still half of what one device allows.
const ZERO_PARITY: f64 = 5e-6;
/// Any strategy against one device with the whole batch: f32 sums of the same numbers over
/// other partitions (the bound the `ddp` parity tests hold).
const SINGLE_PARITY: f64 = 1e-5;
/// The same under bf16-mixed: the batch's partial sums are rounded in bf16 (8 bits of
/// mantissa) inside the model's matrix products, another split of the batch rounds other
/// partial sums, and an f32 master weight that moves by one ulp can round to another bf16
/// value in the next step's compute copy. This is the noise floor of bf16 itself.
const SINGLE_PARITY_BF16: f64 = 2e-2;

const STRATEGIES: [&str; 4] = ["ddp", "zero1", "zero2", "zero3"];

/// Which workload a case trains.
#[derive(Clone, Copy)]
enum Workload {
    /// A GPT with odd widths (9 wide, 3 heads: parameters of 9, 81 and 243 elements), AdamW
    /// with weight decay and clipping. Without biases: the attention's key bias has a zero
    /// gradient in exact arithmetic (adding a constant to every key's score leaves the softmax
    /// unchanged), so its computed gradient is rounding noise, which Adam divides by its own
    /// magnitude into full-size steps that no two summation orders agree on.
    Gpt,
    /// An MLP on the digits with odd widths, SGD with momentum.
    Mlp,
}

fn config(workload: Workload, dir: &Path, text: &Path, extra: &[String]) -> kiln::builtin::Config {
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    match workload {
        Workload::Gpt => {
            let mut o = vec![
                "model.gpt.n_embd=9",
                "model.gpt.n_head=3",
                "model.gpt.n_layer=3",
                "model.gpt.block_size=8",
                "model.gpt.bias=false",
                "train.grad_clip=0.5",
                "train.log_every=1",
            ];
            o.extend(extra);
            gpt_config(dir, text, &o)
        }
        Workload::Mlp => {
            let mut o = vec![
                "model.kind=\"mlp\"",
                "model.mlp.hidden=[33, 17]",
                "optim.name=\"sgd\"",
                "optim.lr=0.1",
                "optim.momentum=0.9",
            ];
            o.extend(extra);
            small_config(dir, &o)
        }
    }
}

fn final_params(workload: Workload, dir: &Path) -> Vec<Vec<f32>> {
    let device = Device::flex();
    match workload {
        Workload::Gpt => parameter_values(
            &kiln_models::load_family_run::<kiln_models::Gpt>(dir, &device)
                .unwrap()
                .0,
        ),
        Workload::Mlp => parameter_values(&kiln_models::load_run(dir, &device).unwrap()),
    }
}

/// Trains `workload` for 5 steps with every strategy on `n` ranks of batch `b` and with
/// `single` on the whole batch; returns the largest difference of each strategy from `ddp`
/// and of `ddp` from `single`.
fn parity(name: &str, workload: Workload, n: usize, variant: &[&str]) -> (Vec<f64>, f64) {
    let dir = temp_dir(name);
    let text = text_file(&dir);
    let b = 4;
    let run = |label: &str, extra: Vec<String>| {
        let mut o: Vec<String> = vec![
            "train.max_steps=5".into(),
            "train.epochs=0".into(),
            "train.check_replicas=true".into(),
        ];
        o.extend(variant.iter().map(|s| s.to_string()));
        o.extend(extra);
        let run_dir = dir.join(label);
        let result = train(
            &config(workload, &run_dir, &text, &o),
            &RunOptions::default(),
        )
        .unwrap_or_else(|e| panic!("{name} {label}: {e}"));
        assert_eq!(result.summary.strategy, label.split('-').next().unwrap());
        final_params(workload, &run_dir)
    };
    // The same global batch on one device, in the same micro-steps (the text workload draws
    // each micro-step's windows from the micro-step's index).
    let single = run(
        "single",
        vec![
            format!("train.batch_size={}", b * n),
            "hardware.cpu_split=\"off\"".into(),
        ],
    );
    let many: Vec<Vec<Vec<f32>>> = STRATEGIES
        .iter()
        .map(|s| {
            run(
                s,
                vec![
                    format!("train.batch_size={b}"),
                    format!("hardware.devices={n}"),
                    format!("strategy.name={s:?}"),
                ],
            )
        })
        .collect();
    let vs_ddp: Vec<f64> = many
        .iter()
        .map(|p| max_relative_diff(p, &many[0]))
        .collect();
    let vs_single = max_relative_diff(&many[0], &single);
    println!(
        "{name}: vs ddp {:?}, ddp vs single {vs_single:.3e}",
        vs_ddp
            .iter()
            .zip(STRATEGIES)
            .map(|(d, s)| format!("{s} {d:.3e}"))
            .collect::<Vec<_>>()
    );
    (vs_ddp, vs_single)
}

fn check_parity(workload: Workload, tag: &str) {
    let variants: [(&str, &[&str]); 4] = [
        ("plain", &[]),
        ("accumulate", &["train.accumulate=2"]),
        ("bf16", &["precision.mode=\"bf16-mixed\""]),
        ("blocks", &["recompute.mode=\"blocks\""]),
    ];
    let mut failures = Vec::new();
    for n in [2, 4] {
        for (label, variant) in variants {
            let name = format!("zero-parity-{tag}-{label}-{n}");
            let (vs_ddp, vs_single) = parity(&name, workload, n, variant);
            let bf16 = label == "bf16";
            for (s, d) in STRATEGIES.iter().zip(&vs_ddp) {
                // zero1 sees the whole averaged gradient and clips as ddp does: it matches ddp
                // in every precision. zero2 and zero3 add each part's gradients (the tied
                // embedding's head and stem parts) in f32 after their reduce-scatter, where
                // ddp's autodiff adds them in the compute dtype: under bf16 they differ from
                // ddp by no more than ddp differs from one device.
                let bound = if bf16 && *s != "zero1" && *s != "ddp" {
                    2.0 * vs_single
                } else {
                    ZERO_PARITY
                };
                if *d > bound {
                    failures.push(format!("{name}: {s} vs ddp {d:e} (bound {bound:e})"));
                }
            }
            let bound = if bf16 {
                SINGLE_PARITY_BF16
            } else {
                SINGLE_PARITY
            };
            if vs_single > bound || vs_single == 0.0 {
                failures.push(format!(
                    "{name}: ddp vs single {vs_single:e} (bound {bound:e})"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn zero_stages_match_ddp_and_single_on_the_gpt_with_adamw_and_clipping() {
    check_parity(Workload::Gpt, "gpt");
}

#[test]
fn zero_stages_match_ddp_and_single_on_the_mlp_with_sgd_momentum() {
    check_parity(Workload::Mlp, "mlp");
}

/// Within `tolerance` (relative) of `expected`.
fn near(what: &str, got: usize, expected: usize, tolerance: f64) {
    let gap = (got as f64 - expected as f64).abs() / expected as f64;
    assert!(
        gap <= tolerance,
        "{what}: counted {got} bytes, expected {expected} (off by {:.2} %)",
        gap * 100.0
    );
}

#[test]
fn each_rank_holds_a_quarter_of_the_state_plus_one_block_on_four_ranks() {
    let dir = temp_dir("zero-memory");
    let text = text_file(&dir);
    let run_with = |strategy: &str, overlap: &str| {
        let run_dir = dir.join(format!("{strategy}-{overlap}"));
        let o = [
            "model.gpt.n_layer=4",
            "model.gpt.n_embd=48",
            "model.gpt.n_head=4",
            "model.gpt.block_size=16",
            "train.max_steps=2",
            "train.batch_size=2",
            "hardware.devices=4",
            &format!("strategy.name={strategy:?}"),
            &format!("dist.overlap={overlap:?}"),
        ];
        train(&gpt_config(&run_dir, &text, &o), &RunOptions::default())
            .unwrap()
            .summary
    };
    let run = |strategy: &str| run_with(strategy, "off");
    // The model's sizes, from Burn's own count of the exported model.
    let ddp = run("ddp");
    let (model, _) =
        kiln_models::load_family_run::<kiln_models::Gpt>(&dir.join("ddp-off"), &Device::flex())
            .unwrap();
    let full = model.num_params() * 4;
    let blocks: Vec<usize> = model.blocks.iter().map(|b| b.num_params() * 4).collect();
    let largest = *blocks.iter().max().unwrap();
    let rest = full - blocks.iter().sum::<usize>();
    println!("gpt: {full} parameter bytes, largest block {largest}, outside the blocks {rest}");
    // AdamW keeps two moments per parameter.
    for r in 0..4 {
        near(
            "ddp optimizer state",
            ddp.optim_bytes_per_rank[r],
            2 * full,
            0.0,
        );
        near("ddp parameters", ddp.param_bytes_per_rank[r], full, 0.0);
        near("ddp gradients", ddp.grad_bytes_per_rank[r], full, 0.0);
    }
    for strategy in ["zero1", "zero2", "zero3"] {
        let s = run(strategy);
        println!(
            "{strategy}: params {:?} grads {:?} optim {:?}",
            s.param_bytes_per_rank, s.grad_bytes_per_rank, s.optim_bytes_per_rank
        );
        assert_eq!(s.optim_bytes_per_rank.len(), 4);
        for r in 0..4 {
            near(
                &format!("{strategy} optimizer state, rank {r}"),
                s.optim_bytes_per_rank[r],
                2 * full / 4,
                0.02,
            );
            match strategy {
                "zero1" => {
                    near("zero1 gradients", s.grad_bytes_per_rank[r], full, 0.02);
                    near("zero1 parameters", s.param_bytes_per_rank[r], full, 0.02);
                }
                _ => near(
                    &format!("{strategy} gradients, rank {r}"),
                    s.grad_bytes_per_rank[r],
                    full / 4 + largest,
                    0.02,
                ),
            }
            if strategy == "zero3" {
                near(
                    &format!("zero3 parameters, rank {r}"),
                    s.param_bytes_per_rank[r],
                    full / 4 + largest + rest,
                    0.02,
                );
            }
        }
    }
    // With a communication thread: up to two units' gradients wait for it, and zero3 holds
    // the next block, all-gathered ahead of time, beside the one it computes.
    for strategy in ["zero2", "zero3"] {
        let s = run_with(strategy, "on");
        println!(
            "{strategy} overlapped: params {:?} grads {:?}",
            s.param_bytes_per_rank, s.grad_bytes_per_rank
        );
        for r in 0..4 {
            let grads = s.grad_bytes_per_rank[r];
            assert!(
                grads as f64 >= (full / 4 + largest) as f64 * 0.98
                    && grads as f64 <= (full / 4 + 2 * largest) as f64 * 1.02,
                "{strategy} gradients, rank {r}: counted {grads}, expected between one and \
                 two blocks beside the shard"
            );
            if strategy == "zero3" {
                near(
                    &format!("zero3 parameters overlapped, rank {r}"),
                    s.param_bytes_per_rank[r],
                    full / 4 + 2 * largest + rest,
                    0.02,
                );
            }
        }
    }
}

/// Trains the GPT for 8 steps on `devices` ranks of `strategy`, checkpointing every 4.
fn gpt_run(dir: &Path, text: &Path, strategy: &str, devices: usize) -> PathBuf {
    let o = [
        "train.max_steps=8".to_string(),
        "train.log_every=1".into(),
        "train.checkpoint_every=4".into(),
        "train.keep_checkpoints=10".into(),
        "train.grad_clip=1.0".into(),
        format!("train.batch_size={}", 8 / devices),
        format!("hardware.devices={devices}"),
        format!("strategy.name={strategy:?}"),
        "model.gpt.n_layer=3".into(),
    ];
    let o: Vec<&str> = o.iter().map(String::as_str).collect();
    train(&gpt_config(dir, text, &o), &RunOptions::default())
        .unwrap()
        .dir
}

/// Resumes the run in `cut` (cut after step 4) with `strategy` on `devices` ranks.
fn resume_as(cut: &Path, strategy: &str, devices: usize) {
    let (run_dir, ckpt) = kiln::run::resolve_resume(cut).unwrap();
    let config = kiln::builtin::load(
        Some(&run_dir.join("config.toml")),
        &[
            format!("run.dir={:?}", run_dir.display().to_string()),
            format!("hardware.devices={devices}"),
            format!("strategy.name={strategy:?}"),
            format!("train.batch_size={}", 8 / devices),
            // `single` as itself, not the CPU device's per-core sub-replicas.
            format!(
                "hardware.cpu_split={:?}",
                if strategy == "single" { "off" } else { "auto" }
            ),
        ],
    )
    .unwrap();
    let result = train(
        &config,
        &RunOptions {
            resume_from: Some(ckpt),
            ..RunOptions::default()
        },
    )
    .unwrap();
    assert_eq!(result.dir, run_dir);
    assert_eq!(result.summary.strategy, strategy);
    assert_eq!(result.summary.devices, devices);
}

fn losses(dir: &Path) -> Vec<(u64, f64)> {
    train_losses(dir)
        .into_iter()
        .map(|(s, bits)| (s, f64::from_bits(bits)))
        .collect()
}

/// Dropout 0.1 on the GPT, 8 steps on 2 devices: a block recomputed in the backward draws the
/// masks its forward drew, so zero2 with `recompute.mode = "blocks"` and zero3 (which
/// recomputes every block) give zero2's losses and parameters within 1e-5 — and the dropout
/// is live: the losses are not those of zero2 without it.
#[test]
fn recomputed_blocks_draw_their_forwards_dropout_masks() {
    let dir = temp_dir("zero-dropout");
    let text = text_file(&dir);
    let run = |name: &str, extra: &[&str]| {
        let mut o = vec![
            "train.max_steps=8",
            "train.log_every=1",
            "train.grad_clip=1.0",
            "train.batch_size=4",
            "hardware.devices=2",
            "hardware.cpu_split=\"off\"",
            "model.gpt.n_layer=3",
        ];
        o.extend_from_slice(extra);
        train(
            &gpt_config(&dir.join(name), &text, &o),
            &RunOptions::default(),
        )
        .unwrap()
        .dir
    };
    let params = |run: &Path| {
        let device = Device::flex();
        let model = kiln_models::load_family_run::<kiln_models::Gpt>(run, &device)
            .unwrap()
            .0;
        parameter_values(&model)
    };
    let drop = "model.gpt.dropout=0.1";
    let zero2 = run("zero2", &[drop, "strategy.name=\"zero2\""]);
    let plain = run("plain", &["strategy.name=\"zero2\""]);
    assert_ne!(
        losses(&plain),
        losses(&zero2),
        "dropout at 0.1 changed nothing"
    );
    let recomputed = run(
        "recomputed",
        &[drop, "strategy.name=\"zero2\"", "recompute.mode=\"blocks\""],
    );
    let zero3 = run("zero3", &[drop, "strategy.name=\"zero3\""]);
    for (name, got) in [("recompute", &recomputed), ("zero3", &zero3)] {
        let (got_losses, want) = (losses(got), losses(&zero2));
        assert_eq!(got_losses.len(), 8, "{name}");
        for ((s, a), (_, b)) in got_losses.iter().zip(&want) {
            let gap = (a - b).abs() / b.abs();
            println!("{name} with dropout: step {s}: {a:.7} vs {b:.7} ({gap:.2e})");
            assert!(gap <= 1e-5, "{name}, step {s}: {a} vs {b}");
        }
        let d = max_relative_diff(&params(got), &params(&zero2));
        println!("{name} with dropout: max per-tensor relative difference {d:e}");
        assert!(d <= 1e-5, "{name}: {d:e}");
    }
}

#[test]
fn checkpoints_resume_under_another_strategy_and_world_size() {
    let dir = temp_dir("zero-resume");
    let text = text_file(&dir);
    for (from, n_from, to, n_to) in [("ddp", 4, "zero3", 2), ("zero2", 2, "single", 1)] {
        let full = gpt_run(&dir.join(format!("{from}-full")), &text, from, n_from);
        let expected = losses(&full);
        let cut = dir.join(format!("{from}-to-{to}"));
        crate::training::cut_copy(&full, &cut, 4);
        resume_as(&cut, to, n_to);
        let got = losses(&cut);
        assert_eq!(got.len(), expected.len(), "{from} → {to}");
        for ((s, a), (_, b)) in got.iter().zip(&expected) {
            let gap = (a - b).abs() / b.abs();
            println!("{from} {n_from} → {to} {n_to}: step {s}: {a:.7} vs {b:.7} ({gap:.2e})");
            assert!(gap <= 1e-5, "{from} → {to}, step {s}: {a} vs {b}");
        }
    }
    // The same strategy and world size continue bit for bit, through the train binary.
    for (strategy, n) in [("zero3", 2), ("zero1", 2)] {
        let full = gpt_run(&dir.join(format!("{strategy}-same")), &text, strategy, n);
        let cut = dir.join(format!("{strategy}-same-cut"));
        crate::training::cut_copy(&full, &cut, 4);
        let out = train_bin(&dir, &["--resume", cut.to_str().unwrap()]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(train_losses(&cut), train_losses(&full), "{strategy}");
    }
}

#[test]
fn an_optimizer_state_of_another_model_is_a_one_line_error() {
    let dir = temp_dir("zero-wrong-state");
    let run = |name: &str, hidden: &str| {
        let config = small_config(
            &dir.join(name),
            &[
                "model.kind=\"mlp\"",
                &format!("model.mlp.hidden={hidden}"),
                "train.max_steps=2",
            ],
        );
        train(&config, &RunOptions::default()).unwrap().dir
    };
    let a = run("a", "[16]");
    let b = run("b", "[16, 8]");
    let (_, ckpt_a) = kiln::checkpoint::latest(&a).unwrap();
    let (_, ckpt_b) = kiln::checkpoint::latest(&b).unwrap();
    std::fs::copy(
        ckpt_b.join(kiln::checkpoint::OPTIM_FILE),
        ckpt_a.join(kiln::checkpoint::OPTIM_FILE),
    )
    .unwrap();
    // A file that is not the one the checkpoint wrote is caught by its digest first.
    let out = train_bin(&dir, &["--resume", a.to_str().unwrap(), "--max-steps", "3"]);
    crate::common::assert_one_line_error(
        &out,
        &["optimizer.bpk", "corrupt", "no checkpoint is whole"],
    );
    // Sealed as the checkpoint's own (its digest recorded), the other model's state is refused
    // by what it holds, naming the tensor.
    let state_path = ckpt_a.join(kiln::checkpoint::STATE_FILE);
    let mut state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state_path).unwrap()).unwrap();
    let d = kiln::checkpoint::digest(&ckpt_a.join(kiln::checkpoint::OPTIM_FILE)).unwrap();
    state["files"][kiln::checkpoint::OPTIM_FILE] = serde_json::to_value(&d).unwrap();
    std::fs::write(&state_path, serde_json::to_vec(&state).unwrap()).unwrap();
    let out = train_bin(&dir, &["--resume", a.to_str().unwrap(), "--max-steps", "3"]);
    crate::common::assert_one_line_error(&out, &["optimizer.bpk", "head.weight", "[8, 10]"]);
    std::fs::write(
        ckpt_a.join(kiln::checkpoint::OPTIM_FILE),
        b"not a burnpack file",
    )
    .unwrap();
    let out = train_bin(&dir, &["--resume", a.to_str().unwrap(), "--max-steps", "3"]);
    crate::common::assert_one_line_error(&out, &["optimizer.bpk", "corrupt"]);
}

/// What a combination must do: train, or be refused at start with an error naming `key`.
fn expected_refusal(
    model: &str,
    strategy: &str,
    precision: &str,
    recompute: &str,
    sync_bn: bool,
) -> Option<&'static str> {
    let mixed = precision.ends_with("-mixed");
    if sync_bn && recompute == "blocks" {
        return Some("ddp.sync_batchnorm");
    }
    if sync_bn && strategy == "zero3" {
        return Some("ddp.sync_batchnorm");
    }
    if mixed && model == "convnet" {
        return Some("precision.mode");
    }
    None
}

/// Every precision × recompute × sync-BatchNorm × accumulation combination of `strategy`, on
/// the ConvNet with BatchNorm (and the mixed precisions also on the MLP, which has no
/// buffers): each trains a few steps to a finite loss with replicas agreeing, or is refused at
/// start with a one-line configuration error — never a panic.
fn matrix(strategy: &str) {
    let dir = temp_dir(&format!("matrix-{strategy}"));
    let devices = if strategy == "single" { 1 } else { 2 };
    let mut ran = 0;
    let mut refused = 0;
    for model in ["convnet", "mlp"] {
        for precision in ["32", "bf16-mixed", "16-mixed", "bf16-true", "16-true"] {
            if model == "mlp" && !precision.ends_with("-mixed") {
                continue;
            }
            for recompute in ["none", "balanced", "blocks"] {
                for sync_bn in [false, true] {
                    for accumulate in [1, 2] {
                        let label =
                            format!("{model}-{precision}-{recompute}-{sync_bn}-{accumulate}");
                        let stages = if strategy == "pipeline" { 2 } else { 1 };
                        let o = [
                            format!("hardware.devices={devices}"),
                            format!("strategy.name={strategy:?}"),
                            format!("pipeline.stages={stages}"),
                            format!(
                                "pipeline.microbatches={}",
                                if strategy == "pipeline" { 2 } else { 1 }
                            ),
                            format!("precision.mode={precision:?}"),
                            format!("recompute.mode={recompute:?}"),
                            format!("ddp.sync_batchnorm={sync_bn}"),
                            format!("train.accumulate={accumulate}"),
                            format!(
                                "model.kind={:?}",
                                if model == "mlp" { "mlp" } else { "convnet" }
                            ),
                            "model.convnet.channels=[2, 3]".into(),
                            "model.mlp.hidden=[8, 8]".into(),
                            "train.batch_size=4".into(),
                            "train.max_steps=2".into(),
                            "train.check_replicas=true".into(),
                            "optim.eps=1e-4".into(),
                            "monitor.interval_s=0".into(),
                            "monitor.sinks=[\"jsonl\"]".into(),
                        ];
                        let o: Vec<&str> = o.iter().map(String::as_str).collect();
                        let outcome = small_config_checked(&dir.join(&label), &o)
                            .and_then(|c| train(&c, &RunOptions::default()));
                        let expected =
                            expected_refusal(model, strategy, precision, recompute, sync_bn);
                        match (outcome, expected) {
                            (Ok(result), None) => {
                                let loss = result.summary.final_train_loss.unwrap();
                                assert!(loss.is_finite(), "{strategy} {label}: loss {loss}");
                                ran += 1;
                            }
                            (Err(e), Some(key)) => {
                                let message = e.to_string();
                                assert!(
                                    matches!(e, kiln::Error::Config(_)),
                                    "{strategy} {label}: {message}"
                                );
                                assert!(message.contains(key), "{strategy} {label}: {message}");
                                assert!(!message.contains('\n'), "{message}");
                                refused += 1;
                            }
                            (Ok(_), Some(key)) => {
                                panic!("{strategy} {label}: trained, expected a refusal on {key}")
                            }
                            (Err(e), None) => panic!("{strategy} {label}: {e}"),
                        }
                    }
                }
            }
        }
    }
    println!("{strategy}: {ran} combinations trained, {refused} refused");
    assert!(ran > 0 && refused > 0);
}

/// [`small_config`] that returns the configuration error instead of panicking on it.
fn small_config_checked(run_dir: &Path, overrides: &[&str]) -> kiln::Result<kiln::builtin::Config> {
    let mut all = vec![
        "data.dataset=\"digits\"".to_string(),
        "train.log_every=1".to_string(),
        "train.epochs=1".to_string(),
        format!("run.dir={:?}", run_dir.display().to_string()),
    ];
    all.extend(overrides.iter().map(|s| s.to_string()));
    kiln::builtin::load(None, &all)
}

#[test]
fn matrix_single() {
    matrix("single");
}

#[test]
fn matrix_ddp() {
    matrix("ddp");
}

#[test]
fn matrix_zero1() {
    matrix("zero1");
}

#[test]
fn matrix_zero2() {
    matrix("zero2");
}

#[test]
fn matrix_zero3() {
    matrix("zero3");
}

#[test]
fn matrix_pipeline() {
    // Two stages on two devices, two micro-batches per flush.
    matrix("pipeline");
}

#[test]
fn a_true_precision_run_resumes_bit_for_bit() {
    // The optimizer state of bf16-true is bf16: saved exactly as f32 per parameter and cast
    // back on load.
    let dir = temp_dir("true-resume");
    let o = [
        "precision.mode=\"bf16-true\"",
        "hardware.devices=2",
        "strategy.name=\"zero2\"",
        "train.checkpoint_every=4",
        "train.keep_checkpoints=10",
        "train.max_steps=8",
        "optim.eps=1e-4",
    ];
    let full = train(&small_config(&dir.join("full"), &o), &RunOptions::default()).unwrap();
    let cut = dir.join("cut");
    crate::training::cut_copy(&full.dir, &cut, 4);
    let out = train_bin(&dir, &["--resume", cut.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(train_losses(&cut), train_losses(&full.dir));
}

#[test]
fn the_train_command_runs_a_zero_stage_and_reports_its_memory() {
    let dir = temp_dir("zero-cli");
    let out = train_bin(
        &dir,
        &[
            "--devices",
            "2",
            "--strategy",
            "zero3",
            "--max-steps",
            "3",
            "--run-dir",
            "run",
            "--set",
            "model.convnet.channels=[4, 4]",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("strategy     zero3"), "{stdout}");
    assert!(
        stdout.contains("memory       per rank, expected"),
        "{stdout}"
    );
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("run/summary.json")).unwrap()).unwrap();
    assert_eq!(summary["strategy"], "zero3");
    for key in [
        "param_bytes_per_rank",
        "grad_bytes_per_rank",
        "optim_bytes_per_rank",
        "peak_bytes_per_rank",
    ] {
        let per_rank = summary[key].as_array().unwrap();
        assert_eq!(per_rank.len(), 2, "{key}");
        assert!(per_rank.iter().all(|b| b.as_u64().unwrap() > 0), "{key}");
    }
}

#[test]
fn zero_stages_with_synchronised_batchnorm_match_ddp() {
    // The walk cuts each ConvNet block around its BatchNorm; zero2 reduce-scatters each
    // block's gradients on the same walk. zero3 refuses the combination (see the matrix).
    let dir = temp_dir("zero-syncbn");
    let run = |strategy: &str| {
        let config = small_config(
            &dir.join(strategy),
            &[
                "hardware.devices=2",
                &format!("strategy.name={strategy:?}"),
                "ddp.sync_batchnorm=true",
                "model.convnet.batch_norm=true",
                "train.max_steps=5",
                "train.batch_size=8",
                "train.check_replicas=true",
                "optim.name=\"sgd\"",
                "optim.lr=0.1",
            ],
        );
        let result = train(&config, &RunOptions::default()).unwrap();
        parameter_values(&kiln_models::load_run(&result.dir, &Device::flex()).unwrap())
    };
    let ddp = run("ddp");
    for strategy in ["zero1", "zero2"] {
        let d = max_relative_diff(&run(strategy), &ddp);
        println!("sync BatchNorm: {strategy} vs ddp {d:.3e}");
        assert!(d <= ZERO_PARITY, "{strategy}: {d:e}");
    }
}
