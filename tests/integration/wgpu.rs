//! The GPU path on every CI run: Burn's WGPU backend on the software adapter a machine without
//! a GPU has (Mesa's llvmpipe) trains the ConvNet and the GPT from the same weights as the CPU,
//! step by step with the CPU's losses (the GPT over 20 steps). What a GPU run executes beyond
//! the device itself — kiln's loop, the strategies' host collectives, Burn's WGPU kernels and
//! their fusion — runs here. Ignored in the plain test command (a machine may have no adapter
//! at all); CI installs Mesa and runs it (`--ignored wgpu::`).

use std::path::Path;
use std::process::Output;

use crate::common::{assert_one_line_error, summary, temp_dir, train_bin_kept, train_losses};
use crate::kernels::{
    F32, KernelsOnly, SWITCH, Way, assert_all_close, assert_attention_close, attention_and_grads,
    dropout_and_grad, dropout_kernels_mask, embedding_and_grad, gelu_and_grad, kernels_mask,
    linear_and_grads, norm_and_grads, packed_starts, values,
};

/// The relative difference allowed between a WGPU loss and the CPU's at the same step, in f32:
/// the kernels sum in other orders, and a few optimizer steps carry the differences on (7e-8 to
/// 1e-7 measured on llvmpipe over 6 steps).
pub(crate) const F32_TOLERANCE: f64 = 1e-5;
/// The same for mixed precision, where the compute rounds to 8 (bf16) or 11 (f16) bits.
const MIXED_TOLERANCE: f64 = 3e-2;

/// Runs `train` in `cwd` with kiln's cache folder in `cwd/cache`.
fn train_bin(cwd: &Path, args: &[&str]) -> Output {
    train_bin_kept(cwd, &cwd.join("cache"), args)
}

/// Runs `train` in `cwd`, failing with its stderr when it fails.
pub(crate) fn train(cwd: &Path, args: &[&str]) {
    let out = train_bin(cwd, args);
    assert!(
        out.status.success(),
        "train {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The training losses of run `dir`, as numbers.
fn losses(dir: &Path) -> Vec<f64> {
    train_losses(dir)
        .into_iter()
        .map(|(_, bits)| f64::from_bits(bits))
        .collect()
}

/// A two-layer GPT on a text of its own, written into `cwd`: `train`'s arguments.
pub(crate) fn small_gpt(cwd: &Path) -> Vec<String> {
    let text: String = (0..400)
        .map(|i| format!("line {i}: the whale and the sea, the ship and the sky. "))
        .collect();
    std::fs::write(cwd.join("text.txt"), text).unwrap();
    let path = format!("data.path={:?}", cwd.join("text.txt").display().to_string());
    let recipe = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/gpt-text.toml");
    [
        "--config",
        &recipe.display().to_string(),
        "--set",
        &path,
        "--set",
        "model.gpt.n_layer=2",
        "--set",
        "model.gpt.n_embd=32",
        "--set",
        "model.gpt.n_head=2",
        "--set",
        "model.gpt.block_size=16",
        "--batch-size",
        "8",
        "--set",
        "train.val_every=1000",
    ]
    .map(String::from)
    .to_vec()
}

/// Trains `args` from `init` on the CPU and on WGPU (one replica each, `precision`) and
/// compares their losses step by step.
fn cpu_and_wgpu_agree(cwd: &Path, name: &str, args: &[&str], precision: &str, tolerance: f64) {
    cpu_and_device_agree(cwd, name, args, (precision, tolerance), "wgpu");
}

/// [`cpu_and_wgpu_agree`] on `device`'s accelerator.
pub(crate) fn cpu_and_device_agree(
    cwd: &Path,
    name: &str,
    args: &[&str],
    (precision, tolerance): (&str, f64),
    device: &str,
) {
    let mut runs = Vec::new();
    for accelerator in ["cpu", device] {
        let dir = cwd.join(format!("{name}-{precision}-{accelerator}"));
        let dir_arg = dir.display().to_string();
        let mut all = vec![
            "--accelerator",
            accelerator,
            "--precision",
            precision,
            "--run-dir",
            &dir_arg,
            "--set",
            "hardware.cpu_split=false",
            "--set",
            "train.log_every=1",
        ];
        all.extend(args);
        train(cwd, &all);
        runs.push(losses(&dir));
        let summary = summary(&dir);
        let peak = &summary["device_memory_peak"];
        if accelerator == "cpu" {
            assert!(
                peak.is_null(),
                "{name}: a CPU run reports a device pool: {peak}"
            );
        } else {
            // The monitor's samples of Burn's pool on the adapter: held at least what is live.
            let (live, held) = (&peak[0]["pool_in_use_mib"], &peak[0]["pool_reserved_mib"]);
            let (live, held) = (live.as_f64(), held.as_f64());
            assert!(
                matches!((live, held), (Some(l), Some(h)) if h > 0.0 && h >= l),
                "{name}: device_memory_peak {peak}"
            );
        }
    }
    let (cpu, gpu) = (&runs[0], &runs[1]);
    assert_eq!(cpu.len(), gpu.len(), "{name}: steps logged");
    assert!(!cpu.is_empty());
    for (step, (a, b)) in cpu.iter().zip(gpu).enumerate() {
        let rel = (a - b).abs() / a.abs().max(1e-12);
        assert!(
            rel <= tolerance,
            "{name} {precision}: step {}: cpu {a} {device} {b} (relative {rel:.2e} > {tolerance:e})",
            step + 1
        );
    }
}

#[test]
#[ignore = "needs a WGPU adapter (CI: Mesa's llvmpipe); run with --ignored wgpu::"]
fn the_convnet_and_the_gpt_on_wgpu_give_the_cpus_losses() {
    let cwd = temp_dir("wgpu");
    // The same starting weights for both devices: a CPU run's export.
    let init = cwd.join("init");
    let init_arg = init.display().to_string();
    let convnet = [
        "--set",
        "model.convnet.channels=[4, 8]",
        "--batch-size",
        "16",
    ];
    let mut first = vec!["--max-steps", "1", "--run-dir", &init_arg];
    first.extend(convnet);
    train(&cwd, &first);
    let from = format!("init.from={:?}", init.display().to_string());
    let mut steps = vec!["--max-steps", "6", "--set", &from];
    steps.extend(convnet);
    cpu_and_wgpu_agree(&cwd, "convnet", &steps, "32", F32_TOLERANCE);

    // A two-layer GPT on a text of its own, 8 × 64 rows a step: on WGPU its Linears' weight
    // gradients are summed by two parts of the rows (`cube::weight_parts`).
    let mut gpt = small_gpt(&cwd);
    gpt.extend(["--set", "model.gpt.block_size=64"].map(String::from));
    assert_eq!(kiln_models::cube::weight_parts(8 * 64, 32, 96), 2);
    let gpt: Vec<&str> = gpt.iter().map(String::as_str).collect();
    let gpt_init = cwd.join("gpt-init");
    let gpt_init_arg = gpt_init.display().to_string();
    let mut first = vec!["--max-steps", "1", "--run-dir", &gpt_init_arg];
    first.extend(&gpt);
    train(&cwd, &first);
    let from = format!("init.from={:?}", gpt_init.display().to_string());
    // Twenty steps: WGPU's kernels are fused (Burn's `fusion`), the CPU's are not.
    let mut steps = vec!["--max-steps", "20", "--set", &from];
    steps.extend(&gpt);
    cpu_and_wgpu_agree(&cwd, "gpt", &steps, "32", F32_TOLERANCE);
    // What CubeCL learned (autotune's choices) is kept in kiln's cache folder for the next run.
    let kept = cwd.join("cache").join("cubecl");
    let files = std::fs::read_dir(&kept).map_or(0, |d| d.count());
    assert!(files > 0, "nothing kept in {}", kept.display());
    // Mixed precision where the adapter computes in the low dtype; where it does not (llvmpipe
    // computes in neither f16 nor bf16), a refusal in one line before anything is written.
    for mode in ["bf16-mixed", "16-mixed"] {
        let dir = cwd.join(format!("gpt-{mode}-probe"));
        let dir_arg = dir.display().to_string();
        let mut probe = vec![
            "--accelerator",
            "wgpu",
            "--precision",
            mode,
            "--run-dir",
            &dir_arg,
        ];
        probe.extend(&steps);
        let out = train_bin(&cwd, &probe);
        if out.status.success() {
            cpu_and_wgpu_agree(&cwd, "gpt", &steps, mode, MIXED_TOLERANCE);
        } else {
            assert_one_line_error(
                &out,
                &["key `precision.mode`", "does not support", "\"32\""],
            );
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(
                !stderr.contains("or \"16-mixed\""),
                "the refusal suggests a mode the adapter lacks too: {stderr}"
            );
            assert!(!dir.exists(), "a refused run wrote {}", dir.display());
        }
    }
}

/// Two replicas on one adapter (`hardware.replicas_per_device = 2`: the ddp step over the host,
/// each replica half the batch) give one replica's losses at the same global batch, step by
/// step within the f32 tolerance; a strategy that shards the model over devices is refused in
/// one line naming the key, before the run's directory exists.
#[test]
#[ignore = "needs a WGPU adapter (CI: Mesa's llvmpipe); run with --ignored wgpu::"]
fn two_replicas_on_one_adapter_give_one_replicas_losses() {
    let cwd = temp_dir("wgpu-replicas");
    let mut gpt = small_gpt(&cwd);
    gpt.extend(
        [
            "--set",
            "train.log_every=1",
            "--max-steps",
            "6",
            "--accelerator",
            "wgpu",
        ]
        .map(String::from),
    );
    let run = |name: &str, more: &[&str]| {
        let dir = cwd.join(name);
        let mut all = vec!["--run-dir".to_string(), dir.display().to_string()];
        all.extend(gpt.iter().cloned());
        all.extend(more.iter().map(|s| s.to_string()));
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        (train_bin(&cwd, &all), dir)
    };
    let (out, one) = run("one", &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (out, two) = run("two", &["--set", "hardware.replicas_per_device=2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("2 replicas of 4 samples per device"),
        "{stdout}"
    );
    let summary = summary(&two);
    assert_eq!(
        (
            &summary["devices"],
            &summary["sub_replicas"],
            &summary["strategy"]
        ),
        (&1.into(), &2.into(), &"ddp".into()),
        "{summary}"
    );
    let (a, b) = (losses(&one), losses(&two));
    assert_eq!(a.len(), 6);
    assert_eq!(a.len(), b.len());
    for (step, (x, y)) in a.iter().zip(&b).enumerate() {
        let rel = (x - y).abs() / x.abs().max(1e-12);
        assert!(
            rel <= F32_TOLERANCE,
            "step {}: one replica {x}, two {y} (relative {rel:.2e})",
            step + 1
        );
    }
    let (out, refused) = run(
        "zero3",
        &[
            "--strategy",
            "zero3",
            "--set",
            "hardware.replicas_per_device=2",
        ],
    );
    assert_one_line_error(&out, &["hardware.replicas_per_device = 2", "zero3"]);
    assert!(
        !refused.exists(),
        "a refused run wrote {}",
        refused.display()
    );
}

#[test]
#[ignore = "needs a WGPU adapter (CI: Mesa's llvmpipe); run with --ignored wgpu::"]
fn at_a_runs_end_only_the_ranks_thread_holds_pages_on_wgpu() {
    // A GPU runtime keeps pools per thread. The start-up's checks, its forward and the
    // planner's probe (measured now: plan_cache off) run on threads of their own; their
    // pages are handed back before the rank starts, not kept beside its own for the run.
    let cwd = temp_dir("wgpu-pages");
    let dir = cwd.join("run");
    let mut all = vec![
        "--run-dir".to_string(),
        dir.display().to_string(),
        "--accelerator".into(),
        "wgpu".into(),
        "--max-steps".into(),
        "3".into(),
        "--set".into(),
        "hardware.plan_cache=false".into(),
    ];
    all.extend(small_gpt(&cwd));
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    train(&cwd, &all);
    let summary = summary(&dir);
    let pools = summary["device_pools"]
        .as_array()
        .unwrap_or_else(|| panic!("no device_pools in {summary}"));
    // Each thread that allocated has one pool for small allocations (CubeCL's: pages of
    // 8 MiB, none larger than 64 KiB served), which holds a page while the thread has
    // anything live; the small GPT's tensors are carved from pages of 2 MiB.
    let small: Vec<_> = pools
        .iter()
        .filter(|p| p["page_mib"] == 8.0 && p["largest_alloc_mib"].as_f64().unwrap() <= 0.0625)
        .collect();
    let count = |key: &str| small.iter().filter(|p| p[key].as_u64() > Some(0)).count();
    let (used, holding) = (count("pages_peak"), count("pages"));
    assert!(
        used >= 2 && holding == 1,
        "{used} threads allocated, {holding} hold pages at the end: {pools:?}"
    );
}

/// The first WGPU adapter, on which the GPU kernels run (called with [`SWITCH`] held).
fn wgpu_device() -> burn::prelude::Device {
    let wgpu = burn::prelude::Device::enumerate(burn::tensor::DeviceType::Wgpu)
        .into_iter()
        .next()
        .expect("a WGPU adapter");
    assert!(
        kiln_models::cube::kernels_here(burn::tensor::DType::F32, &wgpu),
        "the GPU kernels are not taken on {wgpu:?}"
    );
    wgpu
}

/// The embedding's GPU kernel (its gradient summed by parts of the batch) against Burn's
/// embedding on the same adapter and on the CPU: the lookup the same to the bit, the table's
/// gradient within 1e-5 relative, over a batch that is not a whole number of parts, a token
/// that repeats in every part and tokens that never occur.
#[test]
#[ignore = "needs a WGPU adapter (CI: Mesa's llvmpipe); run with --ignored wgpu::"]
fn the_embedding_kernel_gives_burns_gradient_on_wgpu() {
    use burn::prelude::*;
    let _switch = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let wgpu = wgpu_device();
    assert!(kiln_models::cube::kernels_here(
        burn::tensor::DType::F32,
        &wgpu.clone().autodiff()
    ));
    let (vocab, width, batch, t) = (37, 24, 3, 411);
    // Every 5th token is 0; the others spread over 1..31 (31..36 never occur).
    let tokens: Vec<i64> = (0..batch * t)
        .map(|i| if i % 5 == 0 { 0 } else { (i * 7 % 31) as i64 })
        .collect();
    let rows = batch * t;
    assert!(kiln_models::cube::parts(rows, vocab, width) > 1);
    assert!(!rows.is_multiple_of(kiln_models::cube::ROWS_PER_PART));
    let (y, grad) = embedding_and_grad(&wgpu, (vocab, width), &tokens, batch, F32);
    let off = KernelsOnly::new(&[]);
    let (burn_y, burn_grad) = embedding_and_grad(&wgpu, (vocab, width), &tokens, batch, F32);
    drop(off);
    let (cpu_y, cpu_grad) =
        embedding_and_grad(&Device::flex(), (vocab, width), &tokens, batch, F32);
    assert_eq!(y, burn_y, "the lookup differs from Burn's");
    assert_eq!(y, cpu_y, "the lookup differs from the CPU's");
    let scale = cpu_grad.iter().fold(0f32, |m, g| m.max(g.abs()));
    for (name, other) in [("Burn's on WGPU", &burn_grad), ("the CPU's", &cpu_grad)] {
        for (i, (a, b)) in grad.iter().zip(other.iter()).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * scale,
                "gradient element {i} (row {}): kernel {a}, {name} {b}",
                i / width
            );
        }
    }
    // The rows no token names get nothing; the repeated token's row the most.
    assert!(grad[31 * width..].iter().all(|g| *g == 0.0));
    assert!(grad[..width].iter().any(|g| *g != 0.0));
}

/// Six AdamW steps of a flat shard with `FlatOptimizer` on `device` at `weight_decay`: the
/// parameters and the state's tensors after them.
fn adamw_steps(device: &burn::prelude::Device, weight_decay: f64) -> Vec<(String, Vec<f32>)> {
    use burn::prelude::*;
    let n = 1037;
    let config = kiln::config::OptimConfig {
        weight_decay,
        beta2: 0.99,
        ..Default::default()
    };
    let mask: Vec<bool> = (0..n).map(|i| i % 3 != 0).collect();
    let mut optim =
        kiln::optim::FlatOptimizer::new(&config, &mask, burn::tensor::FloatDType::F32, device);
    let tensor = |v: Vec<f32>| Tensor::<1>::from_data(TensorData::new(v, [n]), device);
    let mut params = tensor(values(n, 1).iter().map(|v| v * 0.5).collect());
    for step in 0..6u64 {
        // Gradients from tiny to large, one exactly zero.
        let scale = 10f32.powi(step as i32 - 3);
        let mut g: Vec<f32> = values(n, 10 + step).iter().map(|v| v * scale).collect();
        g[5] = 0.0;
        params = optim.step(1e-3 * (step + 1) as f64, params, tensor(g));
    }
    let mut out = vec![(
        "parameters".to_string(),
        params.into_data().try_to_vec::<f32>().unwrap(),
    )];
    out.extend(optim.export().0);
    out
}

/// AdamW's GPU kernel (one pass over the flat shard) against Burn's AdamW on the same adapter
/// and the CPU's update (Burn's bits): the parameters and both moments within 1e-5 relative
/// after six steps, with decay on two elements in three and without decay.
#[test]
#[ignore = "needs a WGPU adapter (CI: Mesa's llvmpipe); run with --ignored wgpu::"]
fn the_adamw_kernel_gives_burns_update_on_wgpu() {
    let _switch = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let wgpu = wgpu_device();
    for decay in [0.1, 0.0] {
        let kernel = adamw_steps(&wgpu, decay);
        let off = KernelsOnly::new(&[]);
        let burn = adamw_steps(&wgpu, decay);
        drop(off);
        let cpu = adamw_steps(&burn::prelude::Device::flex(), decay);
        assert_eq!(kernel.len(), 3, "parameters and two moments");
        assert_close(
            &kernel,
            &[("Burn's on WGPU", &burn), ("the CPU's", &cpu)],
            decay,
        );
    }
}

/// Six AdamW steps as [`adamw_steps`] (decay 0.1), of which the second and fifth have a NaN in
/// their gradient: `guarded`, every step is given to `FlatOptimizer::step_guarded` with its
/// flag and the flags are read after the third and the sixth; otherwise the two are not taken
/// (the host's refusal). The parameters, the state's tensors and AdamW's count of steps.
fn adamw_guarded_steps(device: &burn::prelude::Device, guarded: bool) -> (Named, String) {
    use burn::prelude::*;
    let n = 1037;
    let config = kiln::config::OptimConfig {
        weight_decay: 0.1,
        beta2: 0.99,
        ..Default::default()
    };
    let mask: Vec<bool> = (0..n).map(|i| i % 3 != 0).collect();
    let mut optim =
        kiln::optim::FlatOptimizer::new(&config, &mask, burn::tensor::FloatDType::F32, device);
    let tensor = |v: Vec<f32>| Tensor::<1>::from_data(TensorData::new(v, [n]), device);
    let mut params = tensor(values(n, 1).iter().map(|v| v * 0.5).collect());
    let taken = [true, false, true, true, false, true];
    for (step, &take) in taken.iter().enumerate() {
        let scale = 10f32.powi(step as i32 - 3);
        let mut g: Vec<f32> = values(n, 10 + step as u64)
            .iter()
            .map(|v| v * scale)
            .collect();
        if !take {
            g[7] = f32::NAN;
        }
        let lr = 1e-3 * (step + 1) as f64;
        if guarded {
            let flag = Tensor::<1>::from_data([f32::from(u8::from(take))], device);
            params = optim.step_guarded(lr, params, tensor(g), flag);
            if step == 2 || step == 5 {
                assert_eq!(optim.settle(), vec![1], "after step {}", step + 1);
            }
        } else if take {
            params = optim.step(lr, params, tensor(g));
        }
    }
    let mut out = vec![(
        "parameters".to_string(),
        params.into_data().try_to_vec::<f32>().unwrap(),
    )];
    let (tensors, scalars) = optim.export();
    out.extend(tensors);
    (out, format!("{:?}", scalars.get("momentum.time")))
}

/// AdamW's GPU kernel given each step's flag on the device (`train.host_waits = "log"`): the
/// steps whose flag is 0 (their gradients hold a NaN) are left undone, and the steps after
/// them are corrected as the host's refusal corrects them — within 1e-5 of the CPU's update
/// without the two steps, the same count of steps; the CPU's guarded loop equal to it to the
/// bit.
#[test]
#[ignore = "needs a WGPU adapter (CI: Mesa's llvmpipe); run with --ignored wgpu::"]
fn the_adamw_kernel_leaves_a_step_refused_on_the_device_undone_on_wgpu() {
    let _switch = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let cpu = burn::prelude::Device::flex();
    let (kernel, kernel_time) = adamw_guarded_steps(&wgpu_device(), true);
    let (refused, refused_time) = adamw_guarded_steps(&cpu, false);
    let (cpu_guarded, cpu_time) = adamw_guarded_steps(&cpu, true);
    assert_eq!(kernel.len(), 3, "parameters and two moments");
    assert!(kernel.iter().all(|(_, v)| v.iter().all(|x| x.is_finite())));
    assert_eq!(cpu_guarded, refused, "the CPU's guarded loop");
    assert_eq!((&kernel_time, &cpu_time), (&refused_time, &refused_time));
    assert!(refused_time.contains('4'), "{refused_time}");
    assert_close(
        &kernel,
        &[("the CPU's without the refused steps", &refused)],
        0.1,
    );
}

/// A NaN batch in a run on WGPU, where `train.host_waits = "auto"` decides on the device: the
/// step is refused there and named when the host reads (step 4 read at step 6's log line and
/// checkpoint), or skipped and counted, the run's losses those of the same run refusing on the
/// host (`"step"`: each step's check read) within the f32 tolerance. (Against the CPU the
/// weights would differ from the start: each device draws its own.)
#[test]
#[ignore = "needs a WGPU adapter (CI: Mesa's llvmpipe); run with --ignored wgpu::"]
fn a_nan_step_on_wgpu_is_refused_on_the_device_and_named_when_read() {
    use crate::robust::nan_run;
    let _switch = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("wgpu-nan");
    let every = [
        "hardware.cpu_split=\"off\"",
        "train.log_every=3",
        "train.checkpoint_every=3",
    ];
    let wgpu = || (vec![wgpu_device()], "wgpu");
    let (stopped, _) = nan_run(&dir.join("stop"), 0, wgpu(), &every);
    let message = stopped.unwrap_err().to_string();
    assert!(message.starts_with("training error: step 4:"), "{message}");
    assert!(message.contains("at step 6"), "{message}");
    let (skipped, _) = nan_run(&dir.join("skip"), 1, wgpu(), &every);
    assert_eq!(skipped.unwrap().steps, 6);
    let mut each_step = every.to_vec();
    each_step.push("train.host_waits=\"step\"");
    let (host, _) = nan_run(&dir.join("host"), 1, wgpu(), &each_step);
    assert_eq!(host.unwrap().steps, 6);
    let records = |run: &str| crate::common::metrics(&dir.join(run), "train");
    let (device, host) = (records("skip"), records("host"));
    assert_eq!(device.len(), 2);
    for (d, h) in device.iter().zip(&host) {
        assert_eq!(d["nonfinite_skipped"], h["nonfinite_skipped"]);
        // The window of steps 4–6 holds step 4's NaN loss on both (written as null).
        match (d["loss"].as_f64(), h["loss"].as_f64()) {
            (Some(a), Some(b)) => assert!(
                (a - b).abs() <= F32_TOLERANCE * b.abs(),
                "step {}: refused on the device {a}, on the host {b}",
                d["step"]
            ),
            (a, b) => assert_eq!(a, b, "step {}", d["step"]),
        }
    }
    assert_eq!(device[1]["nonfinite_skipped"], 1);
    // What both runs' models score after the refused step: the same.
    let val = |run: &str| crate::common::metrics(&dir.join(run), "val");
    let (a, b) = (val("skip"), val("host"));
    let loss = |r: &[serde_json::Value]| r.last().map(|r| r["loss"].as_f64());
    assert!(matches!(loss(&a), Some(Some(x)) if x.is_finite()), "{a:?}");
    let (x, y) = (loss(&a).flatten().unwrap(), loss(&b).flatten().unwrap());
    assert!(
        (x - y).abs() <= F32_TOLERANCE * y.abs(),
        "validation {x} against {y}"
    );
}

/// Named tensors' values.
type Named = Vec<(String, Vec<f32>)>;

/// Each of `kernel`'s tensors within 1e-5 relative of the same in each of `others`.
fn assert_close(kernel: &Named, others: &[(&str, &Named)], decay: f64) {
    for (name, other) in others {
        for ((what, a), (what_other, b)) in kernel.iter().zip(other.iter()) {
            assert_eq!(what, what_other);
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-5 * x.abs().max(y.abs()),
                    "decay {decay}: {what} element {i}: kernel {x}, {name} {y}"
                );
            }
        }
    }
}

/// The attention kernels (forward by tiles with an online softmax, the backward recomputing
/// the scores from each row's log-sum-exp, dropout's mask from its seed) against Burn's
/// composed ops on the CPU and the CPU's fused kernel: the output and the gradients of q, k
/// and v within 1e-5 of each tensor's largest value. The cases: a time that is no whole number
/// of tiles (70, 45, 37 and 20 rows in tiles of 8, 16 or 32 as the adapter's shared memory
/// allows; 20 in less than one tile of 32), grouped-query heads (4 query heads on 2 key/value heads), rows restricted to their
/// packed documents, head widths of 6 (no whole number of the kernels' vectors of four), 16,
/// 24, 64 and 128; dropout on the weights of a keyed forward (the composed ops given the
/// kernels' mask), of all heads, of a tensor-parallel rank's half of them and through the
/// packed projection the GPT attends with. (Burn's composed ops on the adapter
/// itself are left out: their matrix products' autotuning in a test process has hung on
/// llvmpipe; the GPT's run on WGPU in `the_convnet_and_the_gpt_on_wgpu_…` takes them.)
#[test]
#[ignore = "needs a WGPU adapter (CI: Mesa's llvmpipe); run with --ignored wgpu::"]
fn the_attention_kernels_give_burns_output_and_gradients_on_wgpu() {
    use burn::tensor::DType;
    use kiln_models::draw::Part;
    let _switch = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let wgpu = wgpu_device();
    let cpu = burn::prelude::Device::flex();
    // llvmpipe has no matrix units: these kernels, not the `mma` ones, run in every type.
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        assert!(
            !kiln_models::cube::attention_on_matrix_units(dtype, 64, &wgpu),
            "{dtype:?} on the matrix units"
        );
    }
    let packed = packed_starts(70);
    let cases: [([usize; 5], Option<&[i64]>); 7] = [
        ([2, 3, 3, 70, 16], None),
        // A head of 6 floats: the kernels' rows are vectors of four, the last one padded.
        ([1, 2, 1, 45, 6], None),
        ([2, 4, 2, 70, 24], None),
        ([2, 4, 2, 70, 24], Some(&packed)),
        ([1, 2, 1, 45, 64], None),
        ([1, 2, 2, 37, 128], None),
        // Fewer rows than one tile.
        ([2, 2, 1, 20, 16], None),
    ];
    for (dims, starts) in cases {
        let t = dims[3];
        // The kernels' tiles are 8, 16 or 32 rows (4 only where a cube takes one unit).
        assert!(
            !t.is_multiple_of(8),
            "{dims:?}: {t} rows, a whole number of tiles"
        );
        let case = format!("{dims:?} starts {}", starts.is_some());
        let kernel = attention_and_grads(&wgpu, dims, starts, Way::Kernels(None), F32);
        let composed = attention_and_grads(&cpu, dims, starts, Way::Composed(None), F32);
        assert_attention_close(&case, &kernel, "Burn's composed ops", &composed, 1e-5);
        let fused = attention_and_grads(&cpu, dims, starts, Way::CpuFused, F32);
        assert_attention_close(&case, &kernel, "the CPU's fused kernel", &fused, 1e-5);
    }
    // Dropout: the forward's first draw under KEY is the kernels' seed.
    let dropout = burn::nn::DropoutConfig::new(0.25).init();
    let half = Some(Part {
        dim: 1,
        index: 1,
        of: 2,
    });
    for (dims, starts, part) in [
        ([2, 4, 2, 70, 24], Some(packed.as_slice()), None),
        ([1, 2, 1, 45, 64], None, half),
    ] {
        let drop = kernels_mask(&dropout, part, dims[1]);
        let case = format!("{dims:?} with dropout, part {part:?}");
        let kernel = attention_and_grads(
            &wgpu,
            dims,
            starts,
            Way::Kernels(Some((&dropout, part))),
            F32,
        );
        let composed = attention_and_grads(&cpu, dims, starts, Way::Composed(Some(drop)), F32);
        assert_attention_close(
            &case,
            &kernel,
            "Burn's composed ops with the mask",
            &composed,
            1e-5,
        );
        // The dropout is live: without it the output differs.
        let plain = attention_and_grads(&cpu, dims, starts, Way::Composed(None), F32);
        assert!(
            kernel[0]
                .iter()
                .zip(&plain[0])
                .any(|(a, b)| (a - b).abs() > 1e-3),
            "{case}: the same output as without dropout"
        );
    }
    // The GPT's way in, the packed projection, with dropout: the same mask. Its gradient is
    // written in place where the parts' offsets suit the device's alignment (64 floats of a
    // part: 256 bytes) and assembled from three tensors where they do not (15 floats).
    for dims in [[2, 3, 3, 70, 16], [2, 4, 4, 70, 16], [2, 3, 3, 70, 5]] {
        let drop = kernels_mask(&dropout, None, dims[1]);
        let kernel = attention_and_grads(&wgpu, dims, None, Way::Packed(Some(&dropout)), F32);
        let composed = attention_and_grads(&cpu, dims, None, Way::Composed(Some(drop)), F32);
        assert_attention_close(
            &format!("packed {dims:?} with dropout"),
            &kernel,
            "Burn's composed ops with the mask",
            &composed,
            1e-5,
        );
    }
}

/// LayerNorm and RMSNorm on WGPU through the models' path (`kiln_models::cube::norm`: Burn's
/// ops forward, the backward as one kernel), against Burn's modules on the CPU: the output and
/// the gradients of x, γ and β within 1e-5 relative — rows that fill no whole number of the
/// backward's cubes, rows narrower than a cube's units, rows of six columns a unit; turned off
/// alone, Burn's norm again.
#[test]
#[ignore = "needs a WGPU adapter (CI: Mesa's llvmpipe); run with --ignored wgpu::"]
fn the_norms_give_burns_output_and_gradients_on_wgpu() {
    use burn::prelude::*;
    use kiln_models::cube::{GpuKernel, NormTiling, norm_takes};
    let _switch = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let wgpu = wgpu_device();
    let cpu = burn::prelude::Device::flex();
    let x = Tensor::<3>::zeros([2, 3, 24], &wgpu.clone().autodiff());
    let gamma = Tensor::<1>::ones([24], &wgpu.clone().autodiff());
    assert!(
        norm_takes(&x, &gamma),
        "the norms' kernel is not taken on WGPU"
    );
    for dims in [[4, 97, 24], [2, 81, 384]] {
        let tiling = NormTiling::new(dims[0] * dims[1], dims[2], 256);
        assert!(tiling.cubes > 1 && (dims[0] * dims[1]) % tiling.rows != 0);
        for (rms, which) in [
            (false, &["output", "dx", "dgamma", "dbeta"][..]),
            (true, &["output", "dx", "dgamma"][..]),
        ] {
            let kernel = norm_and_grads(&wgpu, dims, rms, false, F32);
            let burn = norm_and_grads(&cpu, dims, rms, true, F32);
            let case = format!("{dims:?} rms {rms}, {tiling:?}");
            assert_all_close(&case, which, &kernel, "Burn's on the CPU", &burn, 1e-5);
        }
    }
    let _only = KernelsOnly::all_but(GpuKernel::Norm);
    assert!(
        !norm_takes(&x, &gamma),
        "the norms' path turned off still runs the kernel"
    );
}

/// The exact GELU on WGPU through the models' path (`kiln_models::cube::gelu`: a kernel forward
/// and backward) against Burn's `gelu` on the CPU: the output and the input's gradient within
/// 1e-5 relative, over more elements than one launch's cubes cover once; turned off alone,
/// Burn's ops again (the same values).
#[test]
#[ignore = "needs a WGPU adapter (CI: Mesa's llvmpipe); run with --ignored wgpu::"]
fn the_gelu_kernels_give_burns_output_and_gradient_on_wgpu() {
    use kiln_models::cube::GpuKernel;
    let _switch = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let wgpu = wgpu_device();
    let cpu = burn::prelude::Device::flex();
    let which = ["output", "dx"];
    for dims in [[3, 5, 7], [4, 1_031, 4_096]] {
        let kernel = gelu_and_grad(&wgpu, dims, false, F32);
        let burn = gelu_and_grad(&cpu, dims, true, F32);
        let case = format!("GELU {dims:?}");
        assert_all_close(&case, &which, &kernel, "Burn's on the CPU", &burn, 1e-5);
    }
    let _only = KernelsOnly::all_but(GpuKernel::Gelu);
    let dims = [3, 5, 7];
    let off = gelu_and_grad(&wgpu, dims, false, F32);
    let burns = gelu_and_grad(&wgpu, dims, true, F32);
    assert_eq!(off, burns, "the GELU's path turned off is not Burn's ops");
}

/// Dropout on WGPU through the models' path in a keyed forward (`kiln_models::draw::dropout`
/// and `dropout_add`: on a GPU the kernel, its mask hashed from the draw's seed) against Burn's
/// ops on the CPU multiplying by the same mask (`DropoutMask::keeps`): the output and the
/// gradients of the input (and the residual) within 1e-5 relative — a whole tensor, one larger
/// than a launch's cubes cover once, and a tensor-parallel rank's part of a whole, alone and
/// added to a residual. Turned off alone, Burn's Bernoulli draw runs: another mask.
#[test]
#[ignore = "needs a WGPU adapter (CI: Mesa's llvmpipe); run with --ignored wgpu::"]
fn the_dropout_kernel_gives_burns_ops_with_its_mask_on_wgpu() {
    use kiln_models::cube::GpuKernel;
    use kiln_models::draw::Part;
    let _switch = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let wgpu = wgpu_device();
    let cpu = burn::prelude::Device::flex();
    let part = Part {
        dim: 1,
        index: 2,
        of: 3,
    };
    for (dims, part) in [
        ([3, 5, 7], None),
        ([4, 1_031, 4_096], None),
        ([2, 6, 10], Some(part)),
    ] {
        let mask = dropout_kernels_mask(dims, part);
        for added in [false, true] {
            let kernel = dropout_and_grad(&wgpu, dims, part, None, added, F32);
            let burn = dropout_and_grad(&cpu, dims, part, Some(&mask), added, F32);
            let which = ["output", "dx", "dresidual"];
            let which = &which[..kernel.len()];
            let case = format!("dropout {dims:?}, part {part:?}, added {added}");
            assert_all_close(&case, which, &kernel, "Burn's with its mask", &burn, 1e-5);
        }
    }
    let _only = KernelsOnly::all_but(GpuKernel::Dropout);
    let dims = [3, 5, 7];
    let mask = dropout_kernels_mask(dims, None);
    for added in [false, true] {
        let off = dropout_and_grad(&wgpu, dims, None, None, added, F32);
        let kernels = dropout_and_grad(&cpu, dims, None, Some(&mask), added, F32);
        assert_ne!(
            off[0], kernels[0],
            "the dropout's path turned off drew the kernel's mask"
        );
    }
}

/// The Linear on WGPU, its weight's gradient summed by parts of the rows
/// (`kiln_models::cube::linear`, `product` for a tied head's transposed table), against Burn's
/// on the CPU: the output and the gradients of the input, weight and bias within 1e-5
/// relative; turned off alone (`set_kernels`), or for a quantized weight, one product again,
/// and on with another path turned off.
#[test]
#[ignore = "needs a WGPU adapter (CI: Mesa's llvmpipe); run with --ignored wgpu::"]
fn the_linear_by_parts_gives_burns_output_and_gradients_on_wgpu() {
    use burn::prelude::*;
    use kiln_models::cube::{GpuKernel, linear_parts};
    let _switch = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let wgpu = wgpu_device();
    let cpu = burn::prelude::Device::flex();
    for (shape, tied) in [((1_024, 24, 40), false), ((1_024, 24, 37), true)] {
        let (rows, inputs, outputs) = shape;
        let device = wgpu.clone().autodiff();
        let x = Tensor::<2>::zeros([rows, inputs], &device);
        let w = Tensor::<2>::zeros([inputs, outputs], &device);
        let parts = linear_parts(&x, &w);
        assert!(parts > 1, "{shape:?}: {parts} part");
        let on_cpu = cpu.clone().autodiff();
        let cpu_parts = linear_parts(
            &Tensor::<2>::zeros([rows, inputs], &on_cpu),
            &Tensor::<2>::zeros([inputs, outputs], &on_cpu),
        );
        assert_eq!(cpu_parts, 1, "the CPU's Linear is cut");
        let split = linear_and_grads(&wgpu, shape, tied);
        let burn = linear_and_grads(&cpu, shape, tied);
        let which: &[&str] = if tied {
            &["output", "dx", "dtable"]
        } else {
            &["output", "dx", "dweight", "dbias"]
        };
        let case = format!("{shape:?} tied {tied} in {parts} parts");
        assert_all_close(&case, which, &split, "the CPU's", &burn, 1e-5);
    }
    let device = wgpu.clone().autodiff();
    let x = Tensor::<2>::zeros([1_024, 24], &device);
    let w = Tensor::<2>::zeros([24, 40], &device);
    {
        let _only = KernelsOnly::all_but(GpuKernel::Linear);
        let off = linear_parts(&x, &w);
        assert_eq!(off, 1, "the Linear's path turned off still cuts");
    }
    {
        // Another path off leaves the Linear's on.
        let _only = KernelsOnly::all_but(GpuKernel::Attention);
        let on = linear_parts(&x, &w);
        assert!(on > 1, "the attention's switch turned the Linear's off");
    }
    // A quantized weight stays one product (Burn's keeps it packed).
    let scheme = burn::tensor::quantization::QuantScheme::default();
    let packed = Tensor::<2>::ones([24, 40], &device).quantize_dynamic(&scheme);
    assert_eq!(linear_parts(&x, &packed), 1, "a quantized weight is cut");
}
