//! The GPU path on every CI run: Burn's WGPU backend on the software adapter a machine without
//! a GPU has (Mesa's llvmpipe) trains the ConvNet and the GPT from the same weights as the CPU,
//! step by step with the CPU's losses (the GPT over 20 steps). What a GPU run executes beyond
//! the device itself — kiln's loop, the strategies' host collectives, Burn's WGPU kernels and
//! their fusion — runs here. Ignored in the plain test command (a machine may have no adapter
//! at all); CI installs Mesa and runs it (`--ignored wgpu::`).

use std::path::Path;
use std::process::Output;

use crate::common::{assert_one_line_error, temp_dir, train_bin_kept, train_losses};

/// The relative difference allowed between a WGPU loss and the CPU's at the same step, in f32:
/// the kernels sum in other orders, and a few optimizer steps carry the differences on (7e-8 to
/// 1e-7 measured on llvmpipe over 6 steps).
const F32_TOLERANCE: f64 = 1e-5;
/// The same for mixed precision, where the compute rounds to 8 (bf16) or 11 (f16) bits.
const MIXED_TOLERANCE: f64 = 3e-2;

/// Runs `train` in `cwd` with kiln's cache folder in `cwd/cache`.
fn train_bin(cwd: &Path, args: &[&str]) -> Output {
    train_bin_kept(cwd, &cwd.join("cache"), args)
}

/// Runs `train` in `cwd`, failing with its stderr when it fails.
fn train(cwd: &Path, args: &[&str]) {
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

/// Trains `args` from `init` on the CPU and on WGPU (one replica each, `precision`) and
/// compares their losses step by step.
fn cpu_and_wgpu_agree(cwd: &Path, name: &str, args: &[&str], precision: &str, tolerance: f64) {
    let mut runs = Vec::new();
    for accelerator in ["cpu", "wgpu"] {
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
        let summary: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap();
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
            "{name} {precision}: step {}: cpu {a} wgpu {b} (relative {rel:.2e} > {tolerance:e})",
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

    // A two-layer GPT on a text of its own.
    let text: String = (0..400)
        .map(|i| format!("line {i}: the whale and the sea, the ship and the sky. "))
        .collect();
    std::fs::write(cwd.join("text.txt"), text).unwrap();
    let path = format!("data.path={:?}", cwd.join("text.txt").display().to_string());
    let recipe = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/gpt-text.toml");
    let recipe = recipe.display().to_string();
    let gpt = [
        "--config",
        &recipe,
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
    ];
    let gpt_init = cwd.join("gpt-init");
    let gpt_init_arg = gpt_init.display().to_string();
    let mut first = vec!["--max-steps", "1", "--run-dir", &gpt_init_arg];
    first.extend(gpt);
    train(&cwd, &first);
    let from = format!("init.from={:?}", gpt_init.display().to_string());
    // Twenty steps: WGPU's kernels are fused (Burn's `fusion`), the CPU's are not.
    let mut steps = vec!["--max-steps", "20", "--set", &from];
    steps.extend(gpt);
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
