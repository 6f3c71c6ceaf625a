//! `diloco` in one process: islands of devices that meet every `diloco.inner_steps` steps.
//! With H = 1, outer lr 1, no outer momentum and SGD inside, an outer step is the mean of the
//! islands' SGD steps, which is `ddp`'s step; a run resumes bit for bit between outer steps;
//! checkpoints of `ddp` resume as DiLoCo and back. (Across processes: `mpi.rs`.)

use std::path::Path;

use burn::prelude::*;
use kiln::builtin::train;
use kiln::run::RunOptions;
use kiln::trainer::parameter_values;

use crate::common::{
    assert_one_line_error, max_relative_diff, metrics, temp_dir, train_bin, train_losses,
};
use crate::gpt::{gpt_config, text_file};
use crate::training::resume_cut;

/// `ddp` against DiLoCo's H = 1 steps: the same mean of gradients, through the parameters
/// (anchor − (anchor − step)) rather than directly: rounding of the parameters' size.
const OUTER_PARITY: f64 = 1e-5;

fn overrides(extra: &[&str]) -> Vec<String> {
    let mut o: Vec<String> = [
        "model.gpt.n_embd=9",
        "model.gpt.n_head=3",
        "model.gpt.n_layer=2",
        "model.gpt.block_size=8",
        "model.gpt.bias=false",
        "train.batch_size=4",
        "train.log_every=1",
        "train.max_steps=12",
        "hardware.devices=2",
        "train.check_replicas=true",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    o.extend(extra.iter().map(|s| s.to_string()));
    o
}

fn run(dir: &Path, text: &Path, extra: &[&str]) -> kiln::RunResult {
    let o = overrides(extra);
    let o: Vec<&str> = o.iter().map(String::as_str).collect();
    train(&gpt_config(dir, text, &o), &RunOptions::default())
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

fn params(dir: &Path) -> Vec<Vec<f32>> {
    parameter_values(
        &kiln_models::load_family_run::<kiln_models::Gpt>(dir, &Device::flex())
            .unwrap()
            .0,
    )
}

const SGD: [&str; 3] = [
    "optim.name=\"sgd\"",
    "optim.lr=0.5",
    "optim.weight_decay=0.0",
];

const OUTER_AS_DDP: [&str; 5] = [
    "strategy.name=\"diloco\"",
    "diloco.islands=2",
    "diloco.inner_steps=1",
    "diloco.outer_lr=1.0",
    "diloco.outer_momentum=0.0",
];

#[test]
fn one_inner_step_with_outer_lr_one_and_sgd_is_ddp() {
    let dir = temp_dir("diloco-h1");
    let text = text_file(&dir);
    let ddp = dir.join("ddp");
    let plain = run(
        &ddp,
        &text,
        &[&SGD[..], &["strategy.name=\"ddp\""]].concat(),
    );
    let islands = dir.join("diloco");
    let result = run(&islands, &text, &[&SGD[..], &OUTER_AS_DDP[..]].concat());
    assert_eq!(result.summary.strategy, "diloco");
    // Each rank holds the anchor (no outer momentum here) beside ddp's optimizer state.
    let n: usize = params(&ddp).iter().map(Vec::len).sum();
    for r in 0..2 {
        assert_eq!(
            result.summary.optim_bytes_per_rank[r],
            plain.summary.optim_bytes_per_rank[r] + n * 4,
            "rank {r}"
        );
    }
    let d = max_relative_diff(&params(&islands), &params(&ddp));
    println!("diloco H=1 vs ddp: {d:.3e}");
    assert!(d <= OUTER_PARITY, "{d:e}");
    // Each island on its own would not be ddp: with H = 3 they drift apart between outer
    // steps and the outer step with lr 1 averages them, which SGD's linearity keeps near
    // ddp but not at it.
    let drift = dir.join("diloco-h3");
    let o = [&SGD[..], &OUTER_AS_DDP[..], &["diloco.inner_steps=3"]].concat();
    run(&drift, &text, &o);
    let d3 = max_relative_diff(&params(&drift), &params(&ddp));
    println!("diloco H=3 vs ddp: {d3:.3e}");
    assert!(d3 > OUTER_PARITY, "{d3:e}");
    // The log says how many outer steps ran.
    let last = metrics(&islands, "train").pop().unwrap();
    assert_eq!(last["outer_steps"], 12, "{last}");
}

#[test]
fn diloco_resumes_between_outer_steps_bit_for_bit() {
    let dir = temp_dir("diloco-resume");
    let text = text_file(&dir);
    let extra = [
        "strategy.name=\"diloco\"",
        "diloco.islands=2",
        "diloco.inner_steps=5",
        "train.checkpoint_every=4",
        "train.keep_checkpoints=5",
    ];
    let full = dir.join("full");
    run(&full, &text, &extra);
    // Step 8 is three steps after the outer step of step 5: the islands differ there.
    let cut = dir.join("cut");
    resume_cut(&full, &cut, 8, &[]);
    assert_eq!(train_losses(&cut), train_losses(&full));
    assert_eq!(params(&cut), params(&full));
    assert!(
        cut.join("checkpoints/step-00000008/optimizer.diloco.bpk")
            .is_file()
    );
    // Sharded: the first island's lead writes the islands' state (its outer loop among it),
    // and the resume between outer steps is the uninterrupted run bit for bit.
    let sharded = dir.join("sharded");
    let with: Vec<&str> = extra
        .iter()
        .copied()
        .chain(["train.checkpoint_format=\"sharded\""])
        .collect();
    run(&sharded, &text, &with);
    let state: serde_json::Value = serde_json::from_slice(
        &std::fs::read(sharded.join("checkpoints/step-00000008/state.json")).unwrap(),
    )
    .unwrap();
    let groups: Vec<&str> = state["sharded"]["optimizers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["group"].as_str().unwrap())
        .collect();
    assert_eq!(groups, ["", "diloco"], "{state}");
    let cut = dir.join("sharded-cut");
    resume_cut(&sharded, &cut, 8, &[]);
    assert_eq!(train_losses(&cut), train_losses(&full));
    assert_eq!(params(&cut), params(&full));
}

#[test]
fn ddp_checkpoints_resume_as_diloco_and_back() {
    // With SGD (its momentum is linear in the gradients, and a DiLoCo checkpoint holds the
    // islands' mean state) and the outer step that equals ddp, a run that changes strategy at
    // its checkpoints ends where ddp ends.
    let dir = temp_dir("diloco-convert");
    let text = text_file(&dir);
    let ckpt = [
        &SGD[..],
        &["train.checkpoint_every=4", "train.keep_checkpoints=5"],
    ]
    .concat();
    let ddp = dir.join("ddp");
    run(
        &ddp,
        &text,
        &[&ckpt[..], &["strategy.name=\"ddp\""]].concat(),
    );
    let as_diloco = dir.join("as-diloco");
    let outer: Vec<String> = OUTER_AS_DDP.iter().map(|s| s.to_string()).collect();
    let r = resume_cut(&ddp, &as_diloco, 4, &outer);
    assert_eq!(r.summary.strategy, "diloco");
    let back = dir.join("back");
    let r = resume_cut(&as_diloco, &back, 8, &["strategy.name=\"ddp\"".to_string()]);
    assert_eq!(r.summary.strategy, "ddp");
    let d = max_relative_diff(&params(&back), &params(&ddp));
    println!("ddp → diloco → ddp vs ddp: {d:.3e}");
    assert!(d <= OUTER_PARITY, "{d:e}");
    // A checkpoint of islands that differ (between outer steps) resumes as ddp from their
    // mean, with AdamW and the paper's outer settings.
    let adam = dir.join("adam");
    run(
        &adam,
        &text,
        &[
            "strategy.name=\"diloco\"",
            "diloco.islands=2",
            "diloco.inner_steps=5",
            "train.checkpoint_every=4",
            "train.keep_checkpoints=5",
        ],
    );
    let to_ddp = dir.join("adam-ddp");
    let r = resume_cut(&adam, &to_ddp, 8, &["strategy.name=\"ddp\"".to_string()]);
    assert!(r.summary.final_train_loss.is_some_and(f64::is_finite));
}

#[test]
fn diloco_refusals_are_one_line() {
    let dir = temp_dir("diloco-refuse");
    let out = train_bin(
        &dir,
        &[
            "--devices",
            "3",
            "--strategy",
            "diloco",
            "--set",
            "diloco.islands=2",
            "--set",
            "train.max_steps=1",
        ],
    );
    assert_one_line_error(&out, &["diloco.islands", "3 ranks"]);
    let out = train_bin(
        &dir,
        &["--strategy", "diloco", "--set", "diloco.inner_steps=0"],
    );
    assert_one_line_error(&out, &["diloco.inner_steps"]);
    let out = train_bin(
        &dir,
        &[
            "--devices",
            "2",
            "--strategy",
            "diloco",
            "--set",
            "model.kind=\"convnet\"",
            "--set",
            "train.max_steps=1",
        ],
    );
    assert_one_line_error(&out, &["diloco", "BatchNorm"]);
    assert!(!dir.join("runs").exists());
}

#[test]
fn the_outer_step_crosses_in_the_reduce_dtype() {
    // H = 1, outer lr 1, no outer momentum: step 2 sets p2 = p1 − b, where b is the islands'
    // mean pseudo-gradient as it crossed between them. With `reduce_dtype = "bf16"` that mean
    // is a bf16 value, so p1 − p2 lies within an f32 rounding of p2 of a bf16 value; an f32
    // mean lies there only by chance.
    let dir = temp_dir("diloco-bf16");
    let text = text_file(&dir);
    let on_bf16_grid = |dtype: &str| {
        let ends: Vec<Vec<f32>> = [1, 2]
            .iter()
            .flat_map(|steps| {
                let run_dir = dir.join(format!("{dtype}-{steps}"));
                let steps = format!("train.max_steps={steps}");
                let reduce = format!("precision.reduce_dtype={dtype:?}");
                let o = [&OUTER_AS_DDP[..], &[&steps, &reduce]].concat();
                run(&run_dir, &text, &o);
                params(&run_dir)
            })
            .collect();
        let half = ends.len() / 2;
        let (p1, p2) = (ends[..half].concat(), ends[half..].concat());
        let near = p1
            .iter()
            .zip(&p2)
            .filter(|(a, b)| {
                let d = **a as f64 - **b as f64;
                let grid = burn::tensor::bf16::from_f64(d).to_f64();
                let ulp = (f32::from_bits(b.abs().to_bits() + 1) - b.abs()) as f64;
                (d - grid).abs() <= ulp
            })
            .count();
        near as f64 / p1.len() as f64
    };
    let (bf16, f32) = (on_bf16_grid("bf16"), on_bf16_grid("f32"));
    println!("steps on the bf16 grid: bf16 {bf16:.4}, f32 {f32:.4}");
    assert!(bf16 >= 0.99, "{bf16}");
    assert!(f32 <= 0.5, "{f32}");
}
