//! Sharded checkpoints (`train.checkpoint_format = "sharded"`): every rank writes the ranges it
//! holds, any world reads them back, and a resume from one is the resume from the gathered
//! checkpoint of the same step, bit for bit.

use std::path::{Path, PathBuf};

use burn::prelude::*;
use kiln::builtin::train;
use kiln::run::RunOptions;
use kiln::trainer::parameter_values;

use crate::common::{max_relative_diff, temp_dir, tensors, train_bin, train_losses};
use crate::gpt::{gpt_config, text_file};

/// Samples per step: every world below divides it.
const SAMPLES: usize = 12;

/// A mesh a run trains on: the strategy, its devices, the tensor-parallel groups' size, and
/// its own settings.
#[derive(Clone, Copy, Debug)]
struct Mesh {
    strategy: &'static str,
    devices: usize,
    tp: usize,
}

impl Mesh {
    const fn of(strategy: &'static str, devices: usize) -> Self {
        Self {
            strategy,
            devices,
            tp: 1,
        }
    }

    const fn tp(strategy: &'static str, devices: usize, tp: usize) -> Self {
        Self {
            strategy,
            devices,
            tp,
        }
    }

    fn overrides(&self, format: &str) -> Vec<String> {
        let mut o = vec![
            format!("parallel.tp={}", self.tp),
            format!("hardware.devices={}", self.devices),
            format!("strategy.name={:?}", self.strategy),
            format!("train.checkpoint_format={format:?}"),
            // `single` as itself, not the CPU device's per-core sub-replicas.
            format!(
                "hardware.cpu_split={:?}",
                if self.strategy == "single" {
                    "off"
                } else {
                    "auto"
                }
            ),
        ];
        if self.strategy == "pipeline" {
            // 2 stages, each on `devices / 2` replicas: micro-batches of 3, 4 a step in all.
            let replicas = self.devices / 2;
            o.extend([
                "pipeline.stages=2".into(),
                format!("pipeline.microbatches={}", 4 / replicas),
                "train.batch_size=3".into(),
            ]);
        } else {
            o.extend([
                format!("train.batch_size={}", SAMPLES * self.tp / self.devices),
                "pipeline.stages=1".into(),
                "pipeline.microbatches=1".into(),
            ]);
        }
        o
    }
}

/// 8 steps of a 3-layer GPT on `mesh`, a checkpoint every 4 in `format`.
fn full_run(dir: &Path, text: &Path, mesh: Mesh, format: &str) -> PathBuf {
    let mut o: Vec<String> = vec![
        "train.max_steps=8".into(),
        "train.log_every=1".into(),
        "train.checkpoint_every=4".into(),
        "train.keep_checkpoints=10".into(),
        "train.grad_clip=1.0".into(),
        "model.gpt.n_layer=3".into(),
    ];
    o.extend(mesh.overrides(format));
    let o: Vec<&str> = o.iter().map(String::as_str).collect();
    train(&gpt_config(dir, text, &o), &RunOptions::default())
        .unwrap()
        .dir
}

/// `full` cut after step 4 into `cut` and resumed on `mesh` (its checkpoints in `format`).
fn resumed(full: &Path, cut: &Path, mesh: Mesh, format: &str) -> PathBuf {
    crate::training::resume_cut(full, cut, 4, &mesh.overrides(format)).dir
}

fn final_params(dir: &Path) -> Vec<Vec<f32>> {
    let device = Device::flex();
    parameter_values(
        &kiln_models::load_family_run::<kiln_models::Gpt>(dir, &device)
            .unwrap()
            .0,
    )
}

/// The weights of the run `run`'s checkpoint of step `step`.
fn checkpoint_params(run: &Path, step: usize) -> Vec<Vec<f32>> {
    let device = Device::flex();
    let (model, _) = kiln_models::load_family_run::<kiln_models::Gpt>(run, &device).unwrap();
    let dir = kiln::checkpoint::step_dir(run, step);
    parameter_values(&kiln::checkpoint::load_model(&dir, model).unwrap())
}

/// Fails naming the first tensor and element where `a` and `b` differ by even one bit.
fn assert_same_bits(a: &[Vec<f32>], b: &[Vec<f32>], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: tensor counts");
    for (t, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.len(), y.len(), "{what}: tensor {t}'s size");
        if let Some(i) = (0..x.len()).find(|&i| x[i].to_bits() != y[i].to_bits()) {
            panic!("{what}: tensor {t} differs at {i}: {} vs {}", x[i], y[i]);
        }
    }
}

/// From each mesh to another — zero3 × 4 → single, single → zero3 × 4, ddp × 2 → zero2 × 3,
/// a pipeline of 2 stages → zero3 × 2, 2 stages × 2 replicas → ddp × 2 and back from zero2 ×
/// 3, dp 2 × tp 2 → single and zero3 × 2 → tp 2 — the run resumed from step 4's sharded checkpoint ends
/// with the parameters, bit for bit, of the same resume from the gathered checkpoint of the
/// same step (which the runs wrote alike: the format changes no number), and its losses are
/// the uninterrupted run's within 1e-5 (across worlds the sums run in another order). On the
/// same mesh (zero3 × 2, a pipeline whose stages each wrote their own units, zero1 × 2 × tp 2
/// whose ranks each wrote their parts) the resume is the uninterrupted run bit for bit.
#[test]
fn sharded_checkpoints_resume_across_meshes_as_gathered_ones_do_bit_for_bit() {
    let dir = temp_dir("shards-resume");
    let text = text_file(&dir);
    let pairs = [
        (Mesh::of("zero3", 4), Mesh::of("single", 1)),
        (Mesh::of("single", 1), Mesh::of("zero3", 4)),
        (Mesh::of("ddp", 2), Mesh::of("zero2", 3)),
        (Mesh::of("pipeline", 2), Mesh::of("zero3", 2)),
        (Mesh::of("pipeline", 4), Mesh::of("ddp", 2)),
        (Mesh::of("zero2", 3), Mesh::of("pipeline", 4)),
        (Mesh::of("zero3", 2), Mesh::of("zero3", 2)),
        (Mesh::of("pipeline", 4), Mesh::of("pipeline", 4)),
        (Mesh::tp("ddp", 4, 2), Mesh::of("single", 1)),
        (Mesh::of("zero3", 2), Mesh::tp("ddp", 2, 2)),
        (Mesh::tp("zero1", 4, 2), Mesh::tp("zero1", 4, 2)),
    ];
    for (from, to) in pairs {
        let tag = format!(
            "{}{}-{}{}",
            from.strategy, from.devices, to.strategy, to.devices
        );
        let sharded = full_run(&dir.join(format!("{tag}-s")), &text, from, "sharded");
        let gathered = full_run(&dir.join(format!("{tag}-g")), &text, from, "gathered");
        assert!(
            kiln::checkpoint::is_sharded(&kiln::checkpoint::step_dir(&sharded, 4))
                && !kiln::checkpoint::is_sharded(&kiln::checkpoint::step_dir(&gathered, 4)),
            "{tag}: the formats asked for"
        );
        if from.tp > 1 {
            // Rank 1 wrote its parts of the cut tensors, not the whole.
            let index =
                kiln::checkpoint::step_dir(&sharded, 4).join(kiln::checkpoint::index_file(1));
            let index = std::fs::read_to_string(index).unwrap();
            assert!(index.contains("#1/2"), "{tag}: {index}");
        }
        assert_same_bits(
            &checkpoint_params(&sharded, 4),
            &checkpoint_params(&gathered, 4),
            &format!("{tag}: the checkpoints' weights"),
        );
        let from_sharded = resumed(&sharded, &dir.join(format!("{tag}-s-cut")), to, "sharded");
        let from_gathered = resumed(&gathered, &dir.join(format!("{tag}-g-cut")), to, "gathered");
        let (s, g) = (final_params(&from_sharded), final_params(&from_gathered));
        assert_same_bits(
            &s,
            &g,
            &format!("{tag}: sharded resume against gathered resume"),
        );
        assert_eq!(
            train_losses(&from_sharded),
            train_losses(&from_gathered),
            "{tag}: losses"
        );
        let (want, got) = (train_losses(&sharded), train_losses(&from_sharded));
        assert_eq!(want.len(), got.len(), "{tag}");
        for ((step, a), (_, b)) in got.iter().zip(&want) {
            let (a, b) = (f64::from_bits(*a), f64::from_bits(*b));
            let gap = (a - b).abs() / b.abs();
            println!("{tag}: step {step}: {a:.7} vs {b:.7} ({gap:.2e})");
            assert!(gap <= 1e-5, "{tag}, step {step}: {a} vs {b}");
        }
        let d = max_relative_diff(&s, &final_params(&sharded));
        println!("{tag}: parameters against the uninterrupted run: {d:e}");
        if from.strategy == to.strategy && from.devices == to.devices && from.tp == to.tp {
            assert_same_bits(&s, &final_params(&sharded), &format!("{tag}: same mesh"));
        }
    }
}

fn ok(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// zero3 on 2 devices, sharded: while rank 1 writes its share of step 20's checkpoint (its
/// writer made slow) the steps go on and rank 0, its own share written, waits to seal; a
/// SIGKILL then leaves no `state.json` for step 20 (rank 0's files and no manifest in the
/// temporary directory), and the resume starts from step 10 and ends bit for bit as the run
/// alone. A flipped byte in one rank's file of the newest checkpoint is named by its file, and
/// the resume passes over it to the checkpoint before, ending bit for bit as the run alone.
#[test]
fn a_rank_killed_mid_write_leaves_no_manifest_and_a_damaged_shard_is_named() {
    let base = temp_dir("shards-kill");
    let train = [
        "--max-steps",
        "40",
        "--devices",
        "2",
        "--strategy",
        "zero3",
        "--set",
        "train.checkpoint_format=\"sharded\"",
        "--set",
        "train.checkpoint_every=10",
        "--set",
        "train.keep_checkpoints=10",
        "--set",
        "train.log_every=1",
        "--set",
        "model.convnet.channels=[2, 2]",
    ];
    ok(&train_bin(
        &base,
        &[&["--run-dir", "alone"][..], &train].concat(),
    ));
    let alone = base.join("alone");
    let steps: Vec<usize> = kiln::checkpoint::list(&alone).iter().map(|c| c.0).collect();
    assert_eq!(steps, [10, 20, 30, 40]);
    let newest = kiln::checkpoint::step_dir(&alone, 40);
    for file in [
        "rank-00000.bin",
        "rank-00001.bin",
        "rest-00000.bpk",
        "state.json",
    ] {
        assert!(newest.join(file).is_file(), "{file}");
    }
    // `train eval` reads the sharded checkpoint as it reads the run's exported weights (the
    // last checkpoint is the last step's).
    let eval = |what: &[&str]| {
        let out = train_bin(&base, &[&["eval"][..], what].concat());
        ok(&out);
        let said = String::from_utf8_lossy(&out.stdout).into_owned();
        // The loss and accuracy (the devices are each config's own).
        let line = said
            .lines()
            .find(|l| l.starts_with("eval: val loss"))
            .unwrap_or_else(|| panic!("no eval line in {said}"));
        line.split(" on ").next().unwrap().to_string()
    };
    let from_checkpoint = eval(&[
        "--set",
        "model.convnet.channels=[2, 2]",
        "--set",
        "init.from=\"alone/checkpoints/step-00000040\"",
    ]);
    assert_eq!(from_checkpoint, eval(&["--run", "alone"]));
    // What reads a weights file otherwise (renames, partial, PyTorch's layout) is refused for
    // a sharded checkpoint in one line, before the run's directory exists.
    for (key, value) in [
        ("init.partial", "true"),
        ("init.rename", "[[\"^conv\", \"c\"]]"),
        ("init.format", "\"pytorch\""),
    ] {
        let set = format!("{key}={value}");
        let out = train_bin(
            &base,
            &[
                &["--run-dir", "refused", "--set"][..],
                &[
                    "init.from=\"alone/checkpoints/step-00000040\"",
                    "--set",
                    &set,
                ],
                &train,
            ]
            .concat(),
        );
        crate::common::assert_one_line_error(&out, &[key, "sharded checkpoint"]);
        assert!(
            !base.join("refused").exists(),
            "{key}: a refused run wrote its directory"
        );
    }
    let mut run = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
        .args(["--run-dir", "killed"])
        .args(train)
        .current_dir(&base)
        .env(kiln::trainer::FAULT_VAR, "1:20:slow-write=30000")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let dir = base.join("killed");
    let started = std::time::Instant::now();
    while crate::common::last_train_step(&dir) < 25 {
        assert!(started.elapsed().as_secs() < 60, "no steps past 25");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let whole: Vec<usize> = kiln::checkpoint::list(&dir).iter().map(|c| c.0).collect();
    assert_eq!(whole, [10]);
    run.kill().unwrap();
    run.wait().unwrap();
    let tmp = kiln::checkpoint::sharded_tmp(&dir, 20);
    assert!(
        tmp.join("rank-00000.json").is_file(),
        "rank 0 wrote its share"
    );
    assert!(!tmp.join("rank-00001.json").exists(), "rank 1 did not");
    assert!(!tmp.join("state.json").exists(), "no manifest");
    let out = train_bin(&base, &[&["--resume", "killed"][..], &train].concat());
    ok(&out);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("from step 10"), "{said}");
    let weights = |run: &str| tensors(&base.join(run).join("model.safetensors"));
    assert!(
        weights("killed") == weights("alone"),
        "the resumed run's weights"
    );

    // A flipped byte in rank 1's file of step 40: passed over, named.
    crate::training::cut_copy(&alone, &base.join("flipped"), 40);
    let file = kiln::checkpoint::step_dir(&base.join("flipped"), 40).join("rank-00001.bin");
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();
    let out = train_bin(&base, &[&["--resume", "flipped"][..], &train].concat());
    ok(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    for needle in [
        "skipping damaged checkpoint step 40",
        "rank-00001.bin",
        "SHA-256",
    ] {
        assert!(stderr.contains(needle), "{needle:?} not in {stderr}");
    }
    assert!(
        weights("flipped") == weights("alone"),
        "the resumed run's weights"
    );
}

/// The ConvNet (whose BatchNorm statistics each pipeline stage writes for its own blocks) on a
/// pipeline of 2 stages × 2 replicas, sharded: resumed as ddp on 2 devices, it ends bit for
/// bit as the resume from the gathered checkpoint of the same run.
#[test]
fn a_pipelines_stages_write_their_own_blocks_and_buffers() {
    let base = temp_dir("shards-pipeline");
    let args = |run: &str, format: &str| -> Vec<String> {
        [
            "--run-dir",
            run,
            "--max-steps",
            "6",
            "--devices",
            "4",
            "--strategy",
            "pipeline",
            "--set",
            "pipeline.stages=2",
            "--set",
            "pipeline.microbatches=2",
            "--set",
            "train.batch_size=8",
            "--set",
            &format!("train.checkpoint_format={format:?}"),
            "--set",
            "train.checkpoint_every=3",
            "--set",
            "train.keep_checkpoints=10",
            "--set",
            "model.convnet.channels=[2, 2]",
        ]
        .map(String::from)
        .to_vec()
    };
    for format in ["sharded", "gathered"] {
        let a = args(format, format);
        ok(&train_bin(
            &base,
            &a.iter().map(String::as_str).collect::<Vec<_>>(),
        ));
        let run = base.join(format);
        crate::training::cut_copy(&run, &base.join(format!("{format}-cut")), 3);
        let cut = format!("{format}-cut");
        let resume = [
            "--resume",
            &cut,
            "--devices",
            "2",
            "--strategy",
            "ddp",
            "--set",
            "pipeline.stages=1",
            "--set",
            "pipeline.microbatches=1",
            "--set",
            "train.batch_size=16",
        ];
        ok(&train_bin(&base, &resume));
    }
    let step3 = kiln::checkpoint::step_dir(&base.join("sharded"), 3);
    for rank in 0..4 {
        assert!(step3.join(kiln::checkpoint::rank_file(rank)).is_file());
    }
    // Each stage's first replica wrote its blocks' tensors outside the pieces.
    for rank in [0, 1] {
        assert!(
            step3.join(kiln::checkpoint::rest_file(rank)).is_file(),
            "{rank}"
        );
    }
    let weights = |run: &str| tensors(&base.join(run).join("model.safetensors"));
    assert!(
        weights("sharded-cut") == weights("gathered-cut"),
        "the resumed runs' weights"
    );
    assert_eq!(
        train_losses(&base.join("sharded-cut")),
        train_losses(&base.join("gathered-cut"))
    );
}

/// Rank 1's writer of step 4's sharded checkpoint fails (`KILN_FAULT_INJECT=1:4:fail-write`, a
/// full disk): rank 0 stops waiting for its share at once rather than for the ten minutes it
/// gives a slow one, the run ends with one line naming the failure, and step 2's checkpoint is
/// the newest whole one.
#[test]
fn a_ranks_failed_write_ends_the_run_at_once_naming_it() {
    let base = temp_dir("shards-fail");
    let started = std::time::Instant::now();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
        .args(["--run-dir", "run", "--max-steps", "8", "--devices", "2"])
        .args(["--strategy", "zero3"])
        .args(["--set", "train.checkpoint_format=\"sharded\""])
        .args(["--set", "train.checkpoint_every=2"])
        .args(["--set", "model.convnet.channels=[2, 2]"])
        .current_dir(&base)
        .env(kiln::trainer::FAULT_VAR, "1:4:fail-write")
        .output()
        .unwrap();
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: checkpoint error:")
            && last.contains("injected failure of rank 1's write"),
        "{stderr}"
    );
    assert!(took.as_secs() < 120, "{took:?}");
    let whole: Vec<usize> = kiln::checkpoint::list(&base.join("run"))
        .iter()
        .map(|c| c.0)
        .collect();
    assert_eq!(whole, [2]);
}
