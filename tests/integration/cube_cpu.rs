//! The GPU kernels in bf16 and f16, on CubeCL's CPU runtime (the `cube-cpu` feature: Burn's
//! `cpu` backend, kernels compiled through LLVM for the host). WGPU's software adapter computes
//! in neither 16-bit type, so this is where the kernels that `bf16-mixed` runs on a GPU are
//! shown: their tensors in the low type, their arithmetic in f32 — within a rounding of the low
//! type of the same computation in f32 on the same (rounded) inputs.

use burn::tensor::DType;

use crate::kernels::{
    F32, Floats, SWITCH, Way, assert_all_close, assert_attention_close, attention_and_grads,
    dropout_and_grad, dropout_kernels_mask, embedding_and_grad, gelu_and_grad, kernels_mask,
    norm_and_grads, packed_starts,
};

/// The relative difference allowed between the GPT's `bf16-mixed` losses here and on the CPU:
/// both round the same ops' outputs to bf16, but in other orders and, in attention and the
/// embedding's gradient, not at all here (4.9e-5 measured over 12 steps; the CPU's own
/// `bf16-mixed` is 5.8e-5 from its f32).
const BF16_TOLERANCE: f64 = 1e-3;

/// CubeCL's CPU device (called with [`SWITCH`] held).
fn cube_cpu() -> burn::prelude::Device {
    let device = burn::prelude::Device::enumerate(burn::tensor::DeviceType::Cpu)
        .into_iter()
        .next()
        .expect("CubeCL's CPU device");
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        assert!(
            kiln_models::cube::kernels_here(dtype, &device),
            "the GPU kernels do not take {dtype:?} on {device:?}"
        );
    }
    device
}

/// The low types and the bound on a kernel's error in each, relative to a tensor's largest
/// value: one unit in the last place of that value at most (bf16 keeps 8 significant bits,
/// so its spacing there is 2⁻⁸ to 2⁻⁷ of it; f16 11, 2⁻¹¹ to 2⁻¹⁰). A result computed in
/// f32 and rounded once is within half of that; the gradients' `δ` is taken from the rounded
/// output, a second rounding. Arithmetic in the low type is not within it (BENCHMARKS.md).
const LOW: [(DType, f32); 2] = [(DType::BF16, 1.0 / 128.0), (DType::F16, 1.0 / 1024.0)];

/// The inputs rounded to `low`, held in `low` (the kernels' tensors).
fn held_in(low: DType) -> Floats {
    Floats {
        round: low,
        compute: low,
    }
}

/// The inputs rounded to `low`, computed in f32 (the reference).
fn rounded_to(low: DType) -> Floats {
    Floats {
        round: low,
        compute: DType::F32,
    }
}

/// The attention kernels with q, k, v and the output's gradient in bf16 and in f16 against
/// Burn's composed ops in f32 on the CPU given the same rounded values: the output and the
/// gradients of q, k and v in the low type, within one unit in its last place of each
/// tensor's largest value; in f32 on this runtime within 1e-5 as on WGPU. The cases: prime
/// times (no whole number of tiles, whatever the host's cores make a tile here), grouped-query
/// heads, rows within packed documents, a head of 64, dropout on the weights (the composed ops
/// given the kernels' mask), and the packed projection the GPT attends through.
#[test]
fn the_attention_kernels_in_bf16_and_f16_are_within_a_rounding_of_f32() {
    let _switch = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let cube = cube_cpu();
    let cpu = burn::prelude::Device::flex();
    // Prime times: a cube here holds as many rows as the host has cores (64 at most).
    let packed = packed_starts(67);
    let cases: [([usize; 5], Option<&[i64]>); 3] = [
        ([2, 4, 2, 67, 24], None),
        ([2, 4, 2, 67, 24], Some(&packed)),
        ([1, 2, 1, 47, 64], None),
    ];
    // The largest difference found in each low type, of a tensor's largest value.
    let mut worst = [0f32; 2];
    let mut note = |low: DType, w: f32| {
        let at = usize::from(low == DType::F16);
        worst[at] = worst[at].max(w);
    };
    for (dims, starts) in cases {
        let case = format!("{dims:?} starts {}", starts.is_some());
        let f32_kernel = attention_and_grads(&cube, dims, starts, Way::Kernels(None), F32);
        let f32_composed = attention_and_grads(&cpu, dims, starts, Way::Composed(None), F32);
        let name = "Burn's composed ops in f32";
        assert_attention_close(&case, &f32_kernel, name, &f32_composed, 1e-5);
        for (low, ulp) in LOW {
            let kernel = attention_and_grads(&cube, dims, starts, Way::Kernels(None), held_in(low));
            let composed =
                attention_and_grads(&cpu, dims, starts, Way::Composed(None), rounded_to(low));
            let case = format!("{case} in {low:?}");
            note(
                low,
                assert_attention_close(&case, &kernel, name, &composed, ulp),
            );
        }
    }
    // The GPT's way in: q, k and v side by side in one projection.
    let dims = [2, 3, 3, 67, 16];
    for (low, ulp) in LOW {
        let kernel = attention_and_grads(&cube, dims, None, Way::Packed(None), held_in(low));
        let composed = attention_and_grads(&cpu, dims, None, Way::Composed(None), rounded_to(low));
        let case = format!("packed in {low:?}");
        let name = "Burn's composed ops in f32";
        note(
            low,
            assert_attention_close(&case, &kernel, name, &composed, ulp),
        );
    }
    // Dropout: the forward's first draw under KEY is the kernels' seed.
    let dropout = burn::nn::DropoutConfig::new(0.25).init();
    let dims = [2, 4, 2, 67, 24];
    let drop = kernels_mask(&dropout, None, dims[1]);
    for (low, ulp) in LOW {
        let way = Way::Kernels(Some((&dropout, None)));
        let kernel = attention_and_grads(&cube, dims, Some(&packed), way, held_in(low));
        let way = Way::Composed(Some(drop));
        let composed = attention_and_grads(&cpu, dims, Some(&packed), way, rounded_to(low));
        let name = "Burn's composed ops in f32 with the mask";
        let case = format!("dropout in {low:?}");
        note(
            low,
            assert_attention_close(&case, &kernel, name, &composed, ulp),
        );
    }
    eprintln!(
        "largest difference from f32, of each tensor's largest value: bf16 {:.2e}, f16 {:.2e}",
        worst[0], worst[1]
    );
}

/// Attention's kernels for the matrix units (`kiln_models::cube::emulate_matrix_units`: this
/// runtime has none, so each 16 × 16 product is summed by the plane's units; the rest — tiles
/// of 16 rows a plane, the softmax and masks by a unit a row, the weights and `p (dp − δ)`
/// rounded to the tensors' type before their products — as on a card's tensor cores) against
/// Burn's composed ops on the CPU: in f32 within 1e-5 of each tensor's largest value; in bf16
/// and f16, against the same computation in f32 on the same rounded values, within two units in
/// the low type's last place (attention's other kernels, which round once, are within one). The
/// cases: prime times and one shorter than a tile, grouped-query heads, packed documents, heads
/// of 16, 32, 64 and 128, dropout, the GPT's packed projection. (WGPU's llvmpipe compiles a
/// kernel's barriers as coroutines: a test of these kernels there ran past fifteen minutes.)
#[test]
fn the_matrix_units_attention_kernels_give_burns_output_and_gradients() {
    use kiln_models::cube::{attention_on_matrix_units, emulate_matrix_units};
    let _switch = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let cube = cube_cpu();
    let cpu = burn::prelude::Device::flex();
    assert!(!attention_on_matrix_units(DType::BF16, 64, &cube));
    emulate_matrix_units(true);
    struct Off;
    impl Drop for Off {
        fn drop(&mut self) {
            kiln_models::cube::emulate_matrix_units(false);
        }
    }
    let _off = Off;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        assert!(attention_on_matrix_units(dtype, 64, &cube), "{dtype:?}");
        assert!(!attention_on_matrix_units(dtype, 24, &cube), "{dtype:?}");
    }
    let packed = packed_starts(67);
    // Dimensions [B, H, KV, T, D], each row's first key, how the kernels are reached.
    type Case<'a> = ([usize; 5], Option<&'a [i64]>, Way<'a>);
    let cases: [Case; 7] = [
        ([2, 4, 2, 67, 32], None, Way::Kernels(None)),
        ([2, 4, 2, 67, 16], Some(&packed), Way::Kernels(None)),
        ([1, 2, 1, 47, 64], None, Way::Kernels(None)),
        ([1, 2, 2, 37, 128], None, Way::Kernels(None)),
        ([2, 2, 1, 13, 16], None, Way::Kernels(None)),
        ([2, 3, 3, 67, 16], None, Way::Packed(None)),
        ([2, 4, 4, 67, 16], None, Way::Packed(None)),
    ];
    let mut worst = [0f32; 2];
    let name = "Burn's composed ops in f32";
    for (dims, starts, way) in cases {
        let case = format!("{dims:?} starts {}", starts.is_some());
        let kernel = attention_and_grads(&cube, dims, starts, way, F32);
        let composed = attention_and_grads(&cpu, dims, starts, Way::Composed(None), F32);
        assert_attention_close(&case, &kernel, name, &composed, 1e-5);
        for (low, ulp) in LOW {
            let kernel = attention_and_grads(&cube, dims, starts, way, held_in(low));
            let composed =
                attention_and_grads(&cpu, dims, starts, Way::Composed(None), rounded_to(low));
            let case = format!("{case} in {low:?}");
            let w = assert_attention_close(&case, &kernel, name, &composed, 2.0 * ulp);
            let at = usize::from(low == DType::F16);
            worst[at] = worst[at].max(w);
        }
    }
    let dropout = burn::nn::DropoutConfig::new(0.25).init();
    let dims = [2, 4, 2, 67, 32];
    let drop = kernels_mask(&dropout, None, dims[1]);
    let name = "Burn's composed ops in f32 with the mask";
    let kernels = Way::Kernels(Some((&dropout, None)));
    let kernel = attention_and_grads(&cube, dims, Some(&packed), kernels, F32);
    let composed = attention_and_grads(&cpu, dims, Some(&packed), Way::Composed(Some(drop)), F32);
    assert_attention_close("dropout", &kernel, name, &composed, 1e-5);
    for (low, ulp) in LOW {
        let kernel = attention_and_grads(&cube, dims, Some(&packed), kernels, held_in(low));
        let way = Way::Composed(Some(drop));
        let composed = attention_and_grads(&cpu, dims, Some(&packed), way, rounded_to(low));
        let case = format!("dropout in {low:?}");
        let w = assert_attention_close(&case, &kernel, name, &composed, 2.0 * ulp);
        let at = usize::from(low == DType::F16);
        worst[at] = worst[at].max(w);
    }
    eprintln!(
        "largest difference from f32, of each tensor's largest value: bf16 {:.2e}, f16 {:.2e}",
        worst[0], worst[1]
    );
}

/// The embedding's kernel with the table and the output's gradient in bf16 and in f16 against
/// Burn's embedding in f32 on the CPU given the same rounded values: the lookup the same, the
/// table's gradient in the low type — the sum of 247 rows for the token that repeats — within
/// one unit in its last place of the largest value (the parts add in f32 and round once).
#[test]
fn the_embedding_kernel_in_bf16_and_f16_is_within_a_rounding_of_f32() {
    let _switch = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let cube = cube_cpu();
    let cpu = burn::prelude::Device::flex();
    let (vocab, width, batch, t) = (37, 24, 3, 411);
    let tokens: Vec<i64> = (0..batch * t)
        .map(|i| if i % 5 == 0 { 0 } else { (i * 7 % 31) as i64 })
        .collect();
    assert!(kiln_models::cube::parts(batch * t, vocab, width) > 1);
    for (low, ulp) in LOW {
        let (y, grad) = embedding_and_grad(&cube, (vocab, width), &tokens, batch, held_in(low));
        let (ref_y, ref_grad) =
            embedding_and_grad(&cpu, (vocab, width), &tokens, batch, rounded_to(low));
        assert_eq!(y, ref_y, "{low:?}: the lookup differs from the CPU's");
        let scale = ref_grad.iter().fold(0f32, |m, g| m.max(g.abs()));
        for (i, (a, b)) in grad.iter().zip(&ref_grad).enumerate() {
            assert!(
                (a - b).abs() <= ulp * scale,
                "{low:?}: gradient element {i} (row {}): kernel {a}, the CPU's in f32 {b}",
                i / width
            );
        }
        assert!(grad[31 * width..].iter().all(|g| *g == 0.0));
    }
}

/// LayerNorm and RMSNorm through the models' path (`kiln_models::cube::norm`: Burn's ops
/// forward, the backward as one kernel) on this runtime: in f32 Burn's modules on the CPU
/// within 1e-5 relative (output, dx, dγ, dβ); with x, γ, β and the output's gradient in bf16
/// and f16, Burn's in f32 on the same rounded values within one unit in the low type's last
/// place of each tensor's largest value (the kernel computes in f32 and rounds once). 111 rows
/// of 40: cubes of 32 rows, the last one short.
#[test]
fn the_norm_kernel_gives_burns_output_and_gradients_in_f32_bf16_and_f16() {
    let _switch = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let cube = cube_cpu();
    let cpu = burn::prelude::Device::flex();
    let dims = [3, 37, 40];
    for (rms, which) in [
        (false, &["output", "dx", "dgamma", "dbeta"][..]),
        (true, &["output", "dx", "dgamma"][..]),
    ] {
        let kernel = norm_and_grads(&cube, dims, rms, false, F32);
        let burn = norm_and_grads(&cpu, dims, rms, true, F32);
        let case = format!("{dims:?} rms {rms} in f32");
        assert_all_close(&case, which, &kernel, "Burn's on the CPU", &burn, 1e-5);
        for (low, ulp) in LOW {
            let kernel = norm_and_grads(&cube, dims, rms, false, held_in(low));
            let reference = norm_and_grads(&cpu, dims, rms, true, rounded_to(low));
            let case = format!("{dims:?} rms {rms} in {low:?}");
            let worst = assert_all_close(&case, which, &kernel, "Burn's in f32", &reference, ulp);
            eprintln!("{case}: largest difference {worst:.2e} of a tensor's largest value");
        }
    }
}

/// The exact GELU through the models' path (`kiln_models::cube::gelu`: a kernel forward and
/// backward) on this runtime: in f32 Burn's `gelu` on the CPU within 1e-5 relative (output
/// and dx); in bf16 and f16, Burn's in f32 on the same rounded values within one unit in the
/// low type's last place of each tensor's largest value (the kernels compute in f32 and round
/// once).
#[test]
fn the_gelu_kernels_give_burns_output_and_gradient_in_f32_bf16_and_f16() {
    let _switch = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let cube = cube_cpu();
    let cpu = burn::prelude::Device::flex();
    let (dims, which) = ([3, 37, 41], ["output", "dx"]);
    let kernel = gelu_and_grad(&cube, dims, false, F32);
    let burn = gelu_and_grad(&cpu, dims, true, F32);
    assert_all_close(
        "GELU in f32",
        &which,
        &kernel,
        "Burn's on the CPU",
        &burn,
        1e-5,
    );
    for (low, ulp) in LOW {
        let kernel = gelu_and_grad(&cube, dims, false, held_in(low));
        let reference = gelu_and_grad(&cpu, dims, true, rounded_to(low));
        let case = format!("GELU in {low:?}");
        let worst = assert_all_close(&case, &which, &kernel, "Burn's in f32", &reference, ulp);
        eprintln!("{case}: largest difference {worst:.2e} of a tensor's largest value");
    }
}

/// Dropout through the models' path in a keyed forward (`kiln_models::draw::dropout` and
/// `dropout_add`: the kernel) on this runtime against Burn's ops multiplying by the same mask:
/// in f32 on the CPU within 1e-5 relative (output, dx and the residual's gradient); in bf16
/// and f16, Burn's in f32 on the same rounded values within one unit in the low type's last
/// place of each tensor's largest value.
#[test]
fn the_dropout_kernel_gives_burns_ops_with_its_mask_in_f32_bf16_and_f16() {
    let _switch = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let cube = cube_cpu();
    let cpu = burn::prelude::Device::flex();
    let dims = [3, 37, 41];
    let mask = dropout_kernels_mask(dims, None);
    for added in [false, true] {
        let which = ["output", "dx", "dresidual"];
        let which = &which[..if added { 3 } else { 2 }];
        let kernel = dropout_and_grad(&cube, dims, None, None, added, F32);
        let burn = dropout_and_grad(&cpu, dims, None, Some(&mask), added, F32);
        let case = format!("dropout in f32, added {added}");
        assert_all_close(&case, which, &kernel, "Burn's with its mask", &burn, 1e-5);
        for (low, ulp) in LOW {
            let kernel = dropout_and_grad(&cube, dims, None, None, added, held_in(low));
            let reference = dropout_and_grad(&cpu, dims, None, Some(&mask), added, rounded_to(low));
            let case = format!("dropout in {low:?}, added {added}");
            let worst = assert_all_close(&case, which, &kernel, "Burn's in f32", &reference, ulp);
            eprintln!("{case}: largest difference {worst:.2e} of a tensor's largest value");
        }
    }
}

/// The small GPT of the WGPU tests on `--accelerator cube-cpu`, from the CPU's weights, for 12
/// steps: in f32 the CPU's losses within 1e-5 (Burn's fused ops and kiln's kernels on this
/// runtime), and in `bf16-mixed` — which no software adapter runs — within 1e-3 of the CPU's
/// `bf16-mixed` losses (4.9e-5 measured). The kernels are on (the tests above show them in
/// bf16, through the GPT's packed attention too); the run shows the rest of the GPU path in
/// bf16 beside them: fusion, the casts of mixed precision, AdamW's kernel on the f32 master
/// weights.
#[test]
fn the_gpt_on_cubecl_cpu_gives_the_cpus_losses_in_f32_and_bf16_mixed() {
    use crate::wgpu::{F32_TOLERANCE, cpu_and_device_agree, small_gpt, train};
    let _switch = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let cwd = crate::common::temp_dir("cube-cpu");
    let gpt = small_gpt(&cwd);
    let gpt: Vec<&str> = gpt.iter().map(String::as_str).collect();
    let init = cwd.join("gpt-init");
    let init_arg = init.display().to_string();
    let mut first = vec!["--max-steps", "1", "--run-dir", &init_arg];
    first.extend(&gpt);
    train(&cwd, &first);
    let from = format!("init.from={:?}", init.display().to_string());
    let mut steps = vec!["--max-steps", "12", "--set", &from];
    steps.extend(&gpt);
    for (precision, tolerance) in [("32", F32_TOLERANCE), ("bf16-mixed", BF16_TOLERANCE)] {
        cpu_and_device_agree(&cwd, "gpt", &steps, (precision, tolerance), "cube-cpu");
    }
}
