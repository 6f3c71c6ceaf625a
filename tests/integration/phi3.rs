//! Phi-3, the family added through the registry (its module and one line in the list):
//! `transformers`' outputs from a checkpoint it made (`tests/fixtures/hf/phi3`: the fused
//! `qkv_proj` and `gate_up_proj`, 12 of a head's 16 dimensions rotating, a tied head, a
//! sliding window of 8 against a 34-token prompt), and a fine-tune of it under each strategy
//! equal to one device's.

use crate::hf::{check, hf_config};

/// Logits within 1e-4, the loss within 1e-5, the greedy tokens with and without the cache.
#[test]
fn a_phi3_checkpoint_with_partial_rotary_a_window_and_a_tied_head_gives_transformers_outputs() {
    check("phi3");
}

/// The whole checkpoint fine-tuned for 10 steps of 8 windows of 16 tokens (the window of 8
/// inside them): under ddp, zero3 and a two-stage pipeline on 2 devices every parameter within
/// 1e-5 of one device's, and one device's moved from the checkpoint.
#[test]
fn a_phi3_fine_tune_under_ddp_zero3_and_the_pipeline_equals_one_device() {
    use kiln::weights::read_tensors;
    let dir = crate::common::temp_dir("phi3-strategies");
    let run = |name: &str, extra: &[&str]| {
        let r = kiln::builtin::train(
            &hf_config(&dir, name, "phi3", extra),
            &kiln::run::RunOptions::default(),
        )
        .unwrap();
        assert!(r.summary.val_loss.unwrap().is_finite(), "{name}");
        read_tensors(&r.dir.join("checkpoints/step-00000010/model.bpk")).unwrap()
    };
    let values = |t: &std::collections::BTreeMap<String, kiln::weights::Stored>| {
        t.values().map(|(_, v)| v.clone()).collect::<Vec<_>>()
    };
    let one = run("one", &[]);
    let names: Vec<&String> = one.keys().collect();
    assert!(
        names.iter().any(|k| k.contains("qkv_proj")) && names.iter().any(|k| k.contains("gate_up")),
        "{names:?}"
    );
    let fixture = crate::hf::fixture("phi3");
    let config = kiln_models::hf::read_config(&fixture).unwrap().phi3;
    let device = burn::prelude::Device::flex();
    let (start, _) =
        kiln_models::hf::load::<kiln_models::Phi3>(&fixture, &config, &device).unwrap();
    let start_file = dir.join("start.safetensors");
    kiln_models::save_safetensors(&start, &start_file).unwrap();
    let start = read_tensors(&start_file).unwrap();
    assert_eq!(start.keys().collect::<Vec<_>>(), names);
    let moved = crate::common::max_relative_diff(&values(&one), &values(&start));
    assert!(
        moved > 1e-3,
        "one device moved {moved:.2e} from the checkpoint"
    );
    let two = ["hardware.devices=2", "train.batch_size=4"];
    for (strategy, extra) in [
        ("ddp", vec!["strategy.name=\"ddp\""]),
        ("zero3", vec!["strategy.name=\"zero3\""]),
        (
            "pipeline",
            vec![
                "strategy.name=\"pipeline\"",
                "pipeline.stages=2",
                "pipeline.microbatches=2",
            ],
        ),
    ] {
        let mut all = two.to_vec();
        all.extend(extra);
        let got = run(strategy, &all);
        assert_eq!(got.keys().collect::<Vec<_>>(), names, "{strategy}");
        let diff = crate::common::max_relative_diff(&values(&got), &values(&one));
        println!("{strategy}: parameters within {diff:.2e} of one device");
        assert!(diff < 1e-5, "{strategy}: {diff}");
    }
}
