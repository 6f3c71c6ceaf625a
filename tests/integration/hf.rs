//! The models people bring: Hugging Face checkpoints made by `transformers`
//! (`tests/fixtures/hf`, written by `xtask/reference/hf_fixtures.py` with their reference
//! logits, loss and greedy continuation) read by kiln's Llama and GPT-2: the same logits within
//! 1e-4 of their scale, the same loss within 1e-5, the same 32 greedy tokens — from a single
//! file, shards and bf16 alike — and decoding with a key/value cache equal to decoding without.

use std::path::{Path, PathBuf};

use burn::prelude::*;
use kiln_models::hf;
use kiln_models::{Gpt2, Llama, ModelKind, ModelSection, Phi3, Sampling};
use serde_json::Value;

pub(crate) fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/hf")
        .join(name)
}

/// A fixture's reference outputs.
struct Reference {
    ids: Vec<u32>,
    logits: Vec<f32>,
    loss: f64,
    continuation: Vec<u32>,
}

fn reference(dir: &Path) -> Reference {
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let nums = |key: &str| -> Vec<f64> {
        v[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    Reference {
        ids: nums("ids").iter().map(|&x| x as u32).collect(),
        logits: nums("logits").iter().map(|&x| x as f32).collect(),
        loss: v["loss"].as_f64().unwrap(),
        continuation: nums("continuation").iter().map(|&x| x as u32).collect(),
    }
}

/// A model of any Hugging Face family, as the fixture's config.json says.
enum Lm {
    Llama(Llama),
    Gpt2(Gpt2),
    Phi3(Phi3),
}

impl Lm {
    fn load(dir: &Path) -> Lm {
        let device = Device::flex();
        let s = hf::read_config(dir).unwrap();
        match s.kind {
            ModelKind::Llama => Lm::Llama(hf::load::<Llama>(dir, &s.llama, &device).unwrap().0),
            ModelKind::Gpt2 => Lm::Gpt2(hf::load::<Gpt2>(dir, &s.gpt2, &device).unwrap().0),
            ModelKind::Phi3 => Lm::Phi3(hf::load::<Phi3>(dir, &s.phi3, &device).unwrap().0),
            kind => panic!("{kind:?}"),
        }
    }

    fn forward(&self, ids: &[u32]) -> Tensor<3> {
        let device = Device::flex();
        let t = ids.len();
        let input = Tensor::<2, Int>::from_data(
            TensorData::new(ids.iter().map(|&i| i64::from(i)).collect(), [1, t]),
            &device,
        );
        match self {
            Lm::Llama(m) => m.forward(input),
            Lm::Gpt2(m) => m.forward(input),
            Lm::Phi3(m) => m.forward(input),
        }
    }

    fn generate(&self, prompt: &[u32], tokens: usize) -> Vec<u32> {
        match self {
            Lm::Llama(m) => m.generate(prompt, tokens, &Sampling::greedy(), || 0.0),
            Lm::Gpt2(m) => m.generate(prompt, tokens, &Sampling::greedy(), || 0.0),
            Lm::Phi3(m) => m.generate(prompt, tokens, &Sampling::greedy(), || 0.0),
        }
    }
}

/// Greedy decoding by a whole forward per token (no cache).
fn greedy_without_cache(model: &Lm, prompt: &[u32], tokens: usize) -> Vec<u32> {
    let mut ids = prompt.to_vec();
    for _ in 0..tokens {
        let logits: Vec<f32> = model.forward(&ids).into_data().try_to_vec().unwrap();
        let v = logits.len() / ids.len();
        let last = &logits[logits.len() - v..];
        ids.push(kiln_models::gpt::sample(last, 0.0, None, 0.0));
    }
    ids
}

/// Fixture `name` read by kiln: transformers' logits within 1e-4 of their scale, its loss
/// within 1e-5, its greedy tokens with the cache, and the same tokens without it.
pub(crate) fn check(name: &str) {
    let dir = fixture(name);
    let r = reference(&dir);
    let model = Lm::load(&dir);
    let logits = model.forward(&r.ids);
    let ours: Vec<f32> = logits.clone().into_data().try_to_vec().unwrap();
    assert_eq!(ours.len(), r.logits.len(), "{name}");
    let scale = r.logits.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let diff = ours
        .iter()
        .zip(&r.logits)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    println!(
        "{name}: logits max |kiln - transformers| / max |transformers| = {:.2e}",
        diff / scale
    );
    assert!(
        diff / scale < 1e-4,
        "{name}: logits differ by {diff} (scale {scale})"
    );
    // The loss of the prompt predicting itself shifted by one.
    let t = r.ids.len();
    let targets = Tensor::<2, Int>::from_data(
        TensorData::new(
            r.ids[1..].iter().map(|&i| i64::from(i)).collect(),
            [1, t - 1],
        ),
        &Device::flex(),
    );
    let v = logits.dims()[2];
    let loss: f32 =
        kiln_models::lm::lm_loss(logits.slice([0..1, 0..t - 1, 0..v]), targets).into_scalar();
    println!("{name}: loss {loss} against {}", r.loss);
    assert!(
        (f64::from(loss) - r.loss).abs() < 1e-5 * r.loss.abs().max(1.0),
        "{name}: loss {loss} against {}",
        r.loss
    );
    let cached = model.generate(&r.ids, r.continuation.len());
    assert_eq!(
        &cached[t..],
        r.continuation.as_slice(),
        "{name}: greedy continuation"
    );
    let plain = greedy_without_cache(&model, &r.ids, r.continuation.len());
    assert_eq!(cached, plain, "{name}: the cache changes the tokens");
}

#[test]
fn a_llama_checkpoint_gives_transformers_logits_loss_and_greedy_tokens() {
    check("llama");
}

#[test]
fn a_sharded_llama_checkpoint_reads_as_the_single_file() {
    check("llama-sharded");
}

#[test]
fn a_bf16_llama_checkpoint_is_cast_to_f32() {
    check("llama-bf16");
}

/// Qwen2: biases on q, k and v only (none zero), the checkpoint's own `model_type`.
#[test]
fn a_qwen2_checkpoint_gives_transformers_logits_loss_and_greedy_tokens() {
    check("qwen2");
}

/// Mistral with a sliding window of 8 against a 34-token prompt: transformers' logits differ
/// from the windowless model's from position 8 on (by up to 1.02× the largest logit, as the
/// fixture script printed), so the window is what is compared, in the forward and in the
/// cached decoding.
#[test]
fn a_mistral_checkpoint_with_a_window_shorter_than_the_prompt_gives_transformers_outputs() {
    check("mistral");
}

/// A Llama whose head is the token embedding (`tie_word_embeddings`, no `lm_head.weight`).
#[test]
fn a_tied_llama_checkpoint_gives_transformers_logits_loss_and_greedy_tokens() {
    check("llama-tied");
}

/// llama3 rope scaling with the head's eight frequencies in all three of its regimes (one kept,
/// one smoothed, six divided by the factor), as transformers computes them.
#[test]
fn llama3_rope_scaling_gives_transformers_logits_loss_and_greedy_tokens() {
    check("llama3-rope");
}

/// Linear rope scaling (positions divided by the factor 2).
#[test]
fn linear_rope_scaling_gives_transformers_logits_loss_and_greedy_tokens() {
    check("llama-linear-rope");
}

#[test]
fn a_gpt2_checkpoint_gives_transformers_logits_loss_and_greedy_tokens() {
    check("gpt2");
}

#[test]
fn an_original_gpt2_layout_without_prefix_and_with_mask_buffers_reads_the_same() {
    check("gpt2-legacy");
    let dir = fixture("gpt2-legacy");
    let c = hf::read_config(&dir)
        .unwrap()
        .config_of::<Gpt2>()
        .unwrap()
        .clone();
    let (_, loaded) = hf::load::<Gpt2>(&dir, &c, &Device::flex()).unwrap();
    assert_eq!(
        loaded.ignored,
        ["transformer.h.0.attn.bias", "transformer.h.1.attn.bias"]
    );
}

/// A copy of fixture `name` in a fresh folder, changed by `change`.
fn altered(name: &str, change: impl FnOnce(&Path)) -> crate::common::TestDir {
    let dir = crate::common::temp_dir(&format!("hf-{name}"));
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    change(&dir);
    dir
}

/// `config.json` of `dir` with `edit` applied.
fn edit_config(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let path = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

#[test]
fn what_kiln_does_not_read_is_refused_in_one_line_naming_file_and_key() {
    let one_line = |e: String, needles: &[&str]| {
        assert_eq!(e.lines().count(), 1, "{e}");
        for n in needles {
            assert!(e.contains(n), "{e:?} lacks {n:?}");
        }
    };
    // An architecture kiln lacks.
    let dir = altered("gpt2", |d| {
        edit_config(d, |v| v["model_type"] = "falcon".into())
    });
    one_line(
        hf::read_config(&dir).unwrap_err(),
        &["config.json", "model_type", "\"falcon\"", "llama"],
    );
    // A key of the wrong type, and one missing, for each family's reader.
    for (name, key, edit) in [
        ("llama", "hidden_size", serde_json::json!("wide")),
        ("gpt2", "n_head", serde_json::json!(-2)),
    ] {
        let dir = altered(name, |d| edit_config(d, |v| v[key] = edit.clone()));
        one_line(
            hf::read_config(&dir).unwrap_err(),
            &["config.json", &format!("key `{key}`"), "invalid"],
        );
        let dir = altered(name, |d| {
            edit_config(d, |v| {
                v.as_object_mut().unwrap().remove(key);
            })
        });
        one_line(
            hf::read_config(&dir).unwrap_err(),
            &["config.json", "missing", key],
        );
    }
    // A rotary scaling kiln lacks, in transformers 5's and 4's keys.
    let dir = altered("llama", |d| {
        edit_config(d, |v| v["rope_parameters"]["rope_type"] = "yarn".into())
    });
    one_line(
        hf::read_config(&dir).unwrap_err(),
        &[
            "config.json",
            "rope_parameters.rope_type",
            "\"yarn\"",
            "llama3",
        ],
    );
    let dir = altered("llama", |d| {
        edit_config(d, |v| {
            let o = v.as_object_mut().unwrap();
            o.remove("rope_parameters");
            o.insert("rope_theta".into(), 500000.0.into());
            o.insert(
                "rope_scaling".into(),
                serde_json::json!({"type": "dynamic", "factor": 2.0}),
            );
        })
    });
    one_line(
        hf::read_config(&dir).unwrap_err(),
        &["rope_scaling.rope_type", "\"dynamic\""],
    );
    // Phi-3's longrope (per-frequency factors), which kiln lacks.
    let dir = altered("phi3", |d| {
        edit_config(d, |v| v["rope_parameters"]["rope_type"] = "longrope".into())
    });
    one_line(
        hf::read_config(&dir).unwrap_err(),
        &["config.json", "rope_parameters.rope_type", "\"longrope\""],
    );
    // A missing shard, named with the index that lists it.
    let dir = altered("llama-sharded", |d| {
        std::fs::remove_file(d.join("model-00002-of-00003.safetensors")).unwrap()
    });
    one_line(
        hf::weight_files(&dir).unwrap_err(),
        &[
            "model.safetensors.index.json",
            "model-00002-of-00003.safetensors",
            "missing",
        ],
    );
    // Weights of another shape than config.json says.
    let dir = altered("llama", |d| {
        edit_config(d, |v| v["intermediate_size"] = 128.into())
    });
    let c = hf::read_config(&dir)
        .unwrap()
        .config_of::<Llama>()
        .unwrap()
        .clone();
    let e = hf::load::<Llama>(&dir, &c, &Device::flex()).unwrap_err();
    println!("{e}");
    one_line(e, &["model.safetensors", "mlp", "shape"]);
    // An export kiln cannot write, refused before the run: a model with no Hugging Face
    // architecture, a shard size that is none.
    let e = kiln::builtin::load(None, &["export.format=\"hf\"".into()]).unwrap_err();
    one_line(e.to_string(), &["export.format", "\"convnet\"", "pytorch"]);
    let e = kiln::builtin::load(None, &["export.shard_mb=0".into()]).unwrap_err();
    one_line(e.to_string(), &["export.shard_mb", "0"]);
}

/// The `config.json` kiln writes for a model it trained from scratch reads back as the same
/// architecture, for each family and variant, with the variant's own `model_type` — a Mistral
/// without a window stays Mistral, a Qwen2 Qwen2 — and a variant's settings that its
/// architecture cannot hold are refused in one line.
#[test]
fn written_configs_read_back_as_the_same_architecture() {
    use kiln_models::llama::{LlamaConfig, LlamaVariant, RopeScaling};
    let llama = LlamaConfig {
        vocab_size: 50,
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 4,
        attention_bias: true,
        mlp_bias: true,
        rope_scaling: Some(RopeScaling::Linear { factor: 2.0 }),
        ..Default::default()
    };
    let plain = LlamaConfig {
        attention_bias: false,
        mlp_bias: false,
        ..llama.clone()
    };
    let qwen2 = LlamaConfig {
        model_type: LlamaVariant::Qwen2,
        rope_scaling: None,
        ..plain.clone()
    };
    let mistral = LlamaConfig {
        model_type: LlamaVariant::Mistral,
        sliding_window: Some(8),
        tie_word_embeddings: true,
        ..plain.clone()
    };
    let mistral_unwindowed = LlamaConfig {
        model_type: LlamaVariant::Mistral,
        ..plain.clone()
    };
    let gpt2 = kiln_models::gpt2::Gpt2Config {
        vocab_size: 50,
        n_embd: 16,
        n_head: 2,
        n_layer: 1,
        ..Default::default()
    };
    let section = |kind, llama: &LlamaConfig| ModelSection {
        kind,
        llama: llama.clone(),
        gpt2: gpt2.clone(),
        ..ModelSection::default()
    };
    for (want_type, arch) in [
        ("llama", section(ModelKind::Llama, &llama)),
        ("qwen2", section(ModelKind::Llama, &qwen2)),
        ("mistral", section(ModelKind::Llama, &mistral)),
        ("mistral", section(ModelKind::Llama, &mistral_unwindowed)),
        ("gpt2", section(ModelKind::Gpt2, &plain)),
    ] {
        arch.validate_family().unwrap();
        let json = arch.hf_json().unwrap();
        assert_eq!(json["model_type"], want_type);
        let back = hf::parse_config(&json).unwrap();
        assert_eq!(back.kind, arch.kind, "{want_type}");
        match arch.kind {
            ModelKind::Llama => assert_eq!(back.llama, arch.llama, "{want_type}"),
            _ => assert_eq!(back.gpt2, arch.gpt2, "{want_type}"),
        }
    }
    // kiln's GPT has no Hugging Face layout.
    assert_eq!(section(ModelKind::Gpt, &plain).hf_json(), None);
    // What a variant's architecture cannot hold.
    for (variant, edit, key) in [
        (LlamaVariant::Qwen2, "mlp_bias", "model.llama.mlp_bias"),
        (
            LlamaVariant::Mistral,
            "attention_bias",
            "model.llama.attention_bias",
        ),
        (
            LlamaVariant::Llama,
            "sliding_window",
            "model.llama.sliding_window",
        ),
    ] {
        let mut c = LlamaConfig {
            model_type: variant,
            ..plain.clone()
        };
        match edit {
            "mlp_bias" => c.mlp_bias = true,
            "attention_bias" => c.attention_bias = true,
            _ => c.sliding_window = Some(8),
        }
        let e = section(ModelKind::Llama, &c).validate_family().unwrap_err();
        assert_eq!(e.lines().count(), 1, "{e}");
        assert!(e.contains(key) && e.contains(variant.model_type()), "{e}");
    }
}

#[test]
fn transformers_4_configs_read_as_5_s() {
    // The same model described with transformers 4's keys: rope_theta at the top, llama3
    // scaling in rope_scaling, no head_dim.
    let json = serde_json::json!({
        "model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 12,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "rope_theta": 500000.0, "tie_word_embeddings": true,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    });
    let c = hf::parse_config(&json)
        .unwrap()
        .config_of::<Llama>()
        .unwrap()
        .clone();
    assert_eq!(
        (c.rope_theta, c.head_width(), c.kv_heads()),
        (500000.0, 4, 1)
    );
    assert!(c.tie_word_embeddings && c.rope_scaling.is_some());
    // Qwen2: biases on q, k and v only.
    let json = serde_json::json!({
        "model_type": "qwen2", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 12,
        "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 1000000.0
    });
    let c = hf::parse_config(&json)
        .unwrap()
        .config_of::<Llama>()
        .unwrap()
        .clone();
    assert!(c.model_type == kiln_models::llama::LlamaVariant::Qwen2 && !c.attention_bias);
}

#[test]
fn llama3_rope_scaling_divides_the_low_frequencies_and_keeps_the_high() {
    let mut c = kiln_models::LlamaConfig {
        hidden_size: 128,
        num_attention_heads: 1,
        rope_theta: 500000.0,
        ..Default::default()
    };
    let plain = c.inv_freq();
    c.rope_scaling = Some(kiln_models::llama::RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    });
    let scaled = c.inv_freq();
    assert_eq!(scaled[0], plain[0], "the highest frequency is kept");
    let last = plain.len() - 1;
    assert!((scaled[last] - plain[last] / 8.0).abs() <= 1e-12 * plain[last].abs().max(1e-30));
}

/// A Llama, a GPT-2 and a Phi-3 trained from scratch (`model.kind = "llama"` / `"gpt2"` /
/// `"phi3"`) write with `export.format = "hf"` a directory whose `config.json` names their
/// family and shape, and which, loaded back as a checkpoint (`model.kind = "hf"`), scores the
/// run's own validation loss on the same windows.
#[test]
fn every_hf_family_from_scratch_exports_a_checkpoint_that_loads_back() {
    let dir = crate::common::temp_dir("hf-scratch");
    let text = crate::gpt::text_file(&dir).display().to_string();
    let tok = fixture("tokenizer").display().to_string();
    let shapes: [(&str, &[&str]); 3] = [
        (
            "llama",
            &[
                "model.llama.hidden_size=32",
                "model.llama.intermediate_size=64",
                "model.llama.num_hidden_layers=2",
                "model.llama.num_attention_heads=2",
                "model.llama.num_key_value_heads=1",
                "model.llama.max_position_embeddings=16",
            ],
        ),
        (
            "gpt2",
            &[
                "model.gpt2.n_embd=32",
                "model.gpt2.n_layer=2",
                "model.gpt2.n_head=2",
                "model.gpt2.n_positions=16",
            ],
        ),
        (
            "phi3",
            &[
                "model.phi3.hidden_size=32",
                "model.phi3.intermediate_size=64",
                "model.phi3.num_hidden_layers=2",
                "model.phi3.num_attention_heads=2",
                "model.phi3.num_key_value_heads=1",
                "model.phi3.max_position_embeddings=16",
                "model.phi3.partial_rotary_factor=0.5",
                "model.phi3.sliding_window=8",
            ],
        ),
    ];
    for (kind, shape) in shapes {
        let common = |run: &str| -> Vec<String> {
            vec![
                "data.dataset=\"text\"".into(),
                format!("data.path={text:?}"),
                format!("data.tokenizer={tok:?}"),
                "data.eval_windows=16".into(),
                "data.context=16".into(),
                "train.epochs=0".into(),
                "train.max_steps=4".into(),
                "train.batch_size=4".into(),
                format!("run.dir={:?}", dir.join(run).display().to_string()),
            ]
        };
        let mut sets = common(kind);
        sets.push(format!("model.kind={kind:?}"));
        sets.push("export.format=\"hf\"".into());
        sets.extend(shape.iter().map(|s| s.to_string()));
        let config = kiln::builtin::load(None, &sets).unwrap();
        let run = kiln::builtin::train(&config, &kiln::run::RunOptions::default()).unwrap();
        let hf = run.dir.join("hf");
        // The token ids it names are none or within the vocabulary (transformers' Phi-3
        // defaults, 32000, are not).
        let json: Value =
            serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap())
                .unwrap();
        for key in ["bos_token_id", "eos_token_id", "pad_token_id"] {
            let id = &json.get(key);
            assert!(
                id.is_none_or(|v| v.is_null() || v.as_u64().is_some_and(|i| i < 384)),
                "{kind}: {key} = {id:?}"
            );
        }
        if kind == "phi3" {
            assert!(
                json.get("pad_token_id").is_some_and(Value::is_null),
                "{json}"
            );
        }
        let arch = kiln_models::hf::read_config(&hf).unwrap();
        match (arch.kind, kind) {
            (ModelKind::Llama, "llama") => {
                let c = &arch.llama;
                assert_eq!((c.hidden_size, c.num_key_value_heads), (32, 1), "{c:?}");
            }
            (ModelKind::Gpt2, "gpt2") => {
                assert_eq!((arch.gpt2.n_embd, arch.gpt2.vocab_size), (32, 384))
            }
            (ModelKind::Phi3, "phi3") => {
                let c = &arch.phi3;
                assert_eq!(
                    (c.partial_rotary_factor, c.sliding_window, c.vocab_size),
                    (0.5, Some(8), 384),
                    "{c:?}"
                );
            }
            _ => panic!("{kind}: exported as {arch:?}"),
        }
        let mut sets = common(&format!("{kind}-back"));
        sets.push("model.kind=\"hf\"".into());
        sets.push(format!("init.from={:?}", hf.display().to_string()));
        let config = kiln::builtin::load(None, &sets).unwrap();
        let options = kiln::run::RunOptions {
            evaluate: true,
            ..Default::default()
        };
        let back = kiln::builtin::train(&config, &options).unwrap();
        let (a, b) = (
            run.summary.val_loss.unwrap(),
            back.summary.val_loss.unwrap(),
        );
        assert!(
            (a - b).abs() < 1e-5 * a,
            "{kind}: the run's {a}, loaded back {b}"
        );
    }
}

/// A run of the `[model] kind = "hf"` fine-tune of fixture `name` on the test text, with
/// `extra` settings, into `dir/run`.
pub(crate) fn hf_config(
    dir: &Path,
    run: &str,
    name: &str,
    extra: &[&str],
) -> kiln::builtin::Config {
    let text = crate::gpt::text_file(dir);
    let from = fixture(name).display().to_string();
    let mut o: Vec<String> = vec![
        "data.dataset=\"text\"".into(),
        format!("data.path={:?}", text.display().to_string()),
        "data.eval_windows=16".into(),
        "data.context=16".into(),
        "model.kind=\"hf\"".into(),
        format!("init.from={from:?}"),
        format!("data.tokenizer={from:?}"),
        "train.epochs=0".into(),
        "train.max_steps=10".into(),
        "train.checkpoint_every=10".into(),
        "train.batch_size=8".into(),
        "train.log_every=5".into(),
        "optim.lr=0.003".into(),
        format!("run.dir={:?}", dir.join(run).display().to_string()),
    ];
    o.extend(extra.iter().map(|s| s.to_string()));
    kiln::builtin::load(None, &o).unwrap()
}

#[test]
fn lora_on_the_llama_checkpoint_under_ddp_zero3_and_pipeline_equals_one_device() {
    use kiln::weights::read_tensors;
    let dir = crate::common::temp_dir("hf-lora");
    let lora = [
        "finetune.lora.rank=4",
        "finetune.lora.alpha=8.0",
        "finetune.lora.targets=[\"**.q_proj\", \"**.v_proj\", \"**.down_proj\"]",
    ];
    let run = |name: &str, extra: &[&str]| {
        let mut all: Vec<&str> = lora.to_vec();
        all.extend(extra);
        let r = kiln::builtin::train(
            &hf_config(&dir, name, "llama", &all),
            &kiln::run::RunOptions::default(),
        )
        .unwrap();
        read_tensors(&r.dir.join("checkpoints/step-00000010/model.bpk")).unwrap()
    };
    let one = run("one", &[]);
    let split = |t: &std::collections::BTreeMap<String, kiln::weights::Stored>, lora: bool| {
        t.iter()
            .filter(|(k, _)| k.contains(".lora.") == lora)
            .map(|(k, (_, v))| (k.clone(), v.clone()))
            .collect::<Vec<_>>()
    };
    let (one_ad, one_base) = (split(&one, true), split(&one, false));
    assert_eq!(one_ad.len(), 2 * 3 * 2, "A and B of 3 targets × 2 layers");
    // Every factor trained away from zero (B starts at zero): equal runs are not idle ones.
    for (k, v) in &one_ad {
        assert!(v.iter().any(|x| *x != 0.0), "{k} is all zero");
    }
    // The frozen base is the checkpoint's, bit for bit.
    let c = hf::read_config(&fixture("llama"))
        .unwrap()
        .config_of::<Llama>()
        .unwrap()
        .clone();
    let (start, _) = hf::load::<Llama>(&fixture("llama"), &c, &Device::flex()).unwrap();
    let start_file = dir.join("start.safetensors");
    kiln_models::save_safetensors(&start, &start_file).unwrap();
    let start = read_tensors(&start_file).unwrap();
    assert_eq!(one_base.len(), start.len());
    for (k, v) in &one_base {
        assert!(
            v.iter()
                .zip(&start[k].1)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{k} moved"
        );
    }
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
        let (ad, base) = (split(&got, true), split(&got, false));
        let diff = crate::common::max_relative_diff(
            &ad.iter().map(|(_, v)| v.clone()).collect::<Vec<_>>(),
            &one_ad.iter().map(|(_, v)| v.clone()).collect::<Vec<_>>(),
        );
        println!("{strategy}: adapters within {diff:.2e} of one device");
        assert!(diff < 1e-5, "{strategy}: {diff}");
        assert_eq!(base, one_base, "{strategy}: the frozen base moved");
    }
}

#[test]
fn a_gpt2_checkpoint_fine_tunes_from_the_cli_and_samples() {
    let dir = crate::common::temp_dir("hf-cli");
    let text = crate::gpt::text_file(&dir);
    let from = fixture("gpt2").display().to_string();
    let run = dir.join("run");
    let sets = [
        "data.dataset=\"text\"".to_string(),
        format!("data.path={:?}", text.display().to_string()),
        "data.eval_windows=8".into(),
        "data.context=16".into(),
        "model.kind=\"hf\"".into(),
        format!("init.from={from:?}"),
        format!("data.tokenizer={from:?}"),
        "train.epochs=0".into(),
        "train.max_steps=6".into(),
        "train.batch_size=4".into(),
    ];
    let mut args: Vec<String> = Vec::new();
    for s in &sets {
        args.push("--set".into());
        args.push(s.clone());
    }
    args.extend(["--devices", "2", "--run-dir"].map(String::from));
    args.push(run.display().to_string());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = crate::common::train_bin(&dir, &args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("28 tensors from"), "{stdout}");
    assert!(stdout.contains("vocabulary 384"), "{stdout}");
    // The run records the family it resolved, and samples with a key/value cache.
    let spec = std::fs::read_to_string(run.join("model.toml")).unwrap();
    assert!(spec.contains("kind = \"gpt2\""), "{spec}");
    let sample = crate::common::train_bin(
        &dir,
        &[
            "sample",
            "--run",
            run.to_str().unwrap(),
            "--prompt",
            "the whale",
            "--tokens",
            "12",
            "--temperature",
            "0",
        ],
    );
    let said = String::from_utf8_lossy(&sample.stdout);
    assert!(
        sample.status.success(),
        "{}",
        String::from_utf8_lossy(&sample.stderr)
    );
    assert!(
        said.starts_with("the whale") && said.len() > "the whale".len(),
        "{said:?}"
    );
    // A tokenizer larger than the checkpoint's vocabulary is refused in one line.
    let big = dir.join("big");
    std::fs::create_dir_all(&big).unwrap();
    let mut sets2 = sets.to_vec();
    sets2[6] = format!("data.tokenizer={:?}", big.display().to_string());
    let trained = kiln_datasets::subword::SubwordTokenizer::train_byte_level(
        &std::fs::read_to_string(&text).unwrap().repeat(3),
        600,
    )
    .unwrap();
    assert!(trained.vocab_size() > 384, "{}", trained.vocab_size());
    {
        trained.save(&big.join("tokenizer.json")).unwrap();
        let mut a: Vec<String> = Vec::new();
        for s in &sets2 {
            a.push("--set".into());
            a.push(s.clone());
        }
        a.extend([
            "--run-dir".to_string(),
            dir.join("never").display().to_string(),
        ]);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let out = crate::common::train_bin(&dir, &a);
        crate::common::assert_one_line_error(&out, &["data.tokenizer", "vocab_size", "384"]);
    }
}

/// Every Hugging Face family under what the rest of kiln offers: recompute equals no recompute bit for
/// bit (f32), bf16-mixed under zero2, DiLoCo's islands, and QLoRA (8-bit bases in f32, 4-bit
/// under bf16-mixed) each train to a finite validation loss below the checkpoint's; QLoRA's
/// adapters move (each `b` factor, zero at the start, is not zero after the steps).
#[test]
fn every_hf_family_takes_recompute_mixed_precision_diloco_and_qlora() {
    use kiln::weights::read_tensors;
    let dir = crate::common::temp_dir("hf-modes");
    for (name, target) in [
        ("llama", "**.q_proj"),
        ("gpt2", "**.c_attn"),
        ("phi3", "**.qkv_proj"),
    ] {
        let qlora = format!("finetune.lora.targets=[{target:?}]");
        let start = kiln::builtin::train(
            &hf_config(&dir, &format!("{name}-start"), name, &[]),
            &kiln::run::RunOptions {
                evaluate: true,
                ..Default::default()
            },
        )
        .unwrap()
        .summary
        .val_loss
        .unwrap();
        let mut params = Vec::new();
        for (label, extra) in [
            ("plain", vec![]),
            ("recompute", vec!["recompute.mode=\"blocks\""]),
            (
                "bf16-zero2",
                vec![
                    "precision.mode=\"bf16-mixed\"",
                    "strategy.name=\"zero2\"",
                    "hardware.devices=2",
                    "train.batch_size=4",
                ],
            ),
            (
                "diloco",
                vec![
                    "strategy.name=\"diloco\"",
                    "diloco.inner_steps=2",
                    "hardware.devices=2",
                    "train.batch_size=4",
                ],
            ),
            (
                "qlora",
                vec![
                    "finetune.lora.rank=4",
                    "finetune.lora.quantize=\"q8\"",
                    qlora.as_str(),
                ],
            ),
            // A quantized base under a bf16 compute copy: the combination QLoRA is for.
            (
                "qlora-bf16",
                vec![
                    "finetune.lora.rank=4",
                    "finetune.lora.quantize=\"q4\"",
                    "precision.mode=\"bf16-mixed\"",
                    qlora.as_str(),
                ],
            ),
        ] {
            let run = format!("{name}-{label}");
            let mut all = vec!["train.max_steps=6", "train.checkpoint_every=6"];
            all.extend(extra);
            let r = kiln::builtin::train(
                &hf_config(&dir, &run, name, &all),
                &kiln::run::RunOptions::default(),
            )
            .unwrap();
            let val = r.summary.val_loss.unwrap();
            println!("{run}: val loss {val:.7} (the checkpoint's {start:.4})");
            assert!(val.is_finite() && val < start, "{run}: {val} from {start}");
            if label.starts_with("qlora") {
                let ck = read_tensors(&r.dir.join("checkpoints/step-00000006/model.bpk")).unwrap();
                let b: Vec<_> = ck.iter().filter(|(k, _)| k.ends_with(".lora.b")).collect();
                assert!(!b.is_empty(), "{run}: no adapter in the checkpoint");
                for (k, (_, v)) in b {
                    assert!(v.iter().any(|x| *x != 0.0), "{run}: {k} did not train");
                }
            }
            if label == "plain" || label == "recompute" {
                params.push(read_tensors(&r.dir.join("model.safetensors")).unwrap());
            }
        }
        assert_eq!(
            params[0], params[1],
            "{name}: recompute changed the parameters"
        );
    }
}

/// The shipped recipes `configs/llama-finetune.toml` and `configs/gpt2-finetune.toml` take
/// another checkpoint of their family by `--set init.from=DIR --set data.tokenizer=DIR` alone
/// (here the sharded Llama and GPT-2's original layout), under zero3 and the pipeline; the
/// run's `train eval` and the recipe's `train plan` take them too.
#[test]
fn the_shipped_hf_recipes_take_another_checkpoint_by_set() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = crate::common::temp_dir("hf-recipes");
    let text = crate::gpt::text_file(&dir).display().to_string();
    let argv = |recipe: &str, from: &str, extra: &[&str]| -> Vec<String> {
        let from = fixture(from).display().to_string();
        let mut a: Vec<String> = vec!["--config".into(), format!("configs/{recipe}.toml")];
        for s in [
            format!("init.from={from:?}"),
            format!("data.tokenizer={from:?}"),
            format!("data.path={text:?}"),
            "data.eval_windows=4".into(),
            "data.context=16".into(),
        ] {
            a.push("--set".into());
            a.push(s);
        }
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let run = |args: &[String]| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = crate::common::train_bin(&root, &args);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    let llama = dir.join("llama").display().to_string();
    let steps = ["--max-steps", "3", "--batch-size", "2", "--devices", "2"];
    let mut a = argv("llama-finetune", "llama-sharded", &steps);
    a.extend(["--strategy", "zero3", "--run-dir", &llama].map(String::from));
    let out = run(&a);
    assert!(out.contains("35 tensors from"), "{out}");
    let adapter: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("llama/hf-adapter/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert!(
        adapter["base_model_name_or_path"]
            .as_str()
            .unwrap()
            .ends_with("llama-sharded"),
        "{adapter}"
    );
    assert!(dir.join("llama/hf/model.safetensors").is_file());
    let out = run(&["eval", "--run", &llama].map(String::from));
    assert!(out.contains("val loss"), "{out}");
    // Every candidate (the table shows the fastest 16 only): each strategy plans the model.
    let mut a = vec!["plan".to_string(), "--json".to_string()];
    a.extend(argv("llama-finetune", "llama", &["--devices", "2"]));
    let out = run(&a);
    for s in ["\"ddp\"", "\"zero3\"", "\"pipeline 2×2 1f1b\""] {
        assert!(out.contains(s), "{s} not planned: {out}");
    }
    let gpt2 = dir.join("gpt2").display().to_string();
    let mut a = argv("gpt2-finetune", "gpt2-legacy", &steps);
    a.extend(
        [
            "--strategy",
            "pipeline",
            "--set",
            "pipeline.microbatches=2",
            "--run-dir",
            &gpt2,
        ]
        .map(String::from),
    );
    let out = run(&a);
    assert!(out.contains("28 tensors from"), "{out}");
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("gpt2/hf/config.json")).unwrap())
            .unwrap();
    assert_eq!(config["model_type"], "gpt2");
}

/// The tensors of a Hugging Face directory's weights files, from their headers: name → (file,
/// dtype, shape, bytes), and each file's metadata.
#[allow(clippy::type_complexity)]
fn layout(
    dir: &Path,
) -> (
    std::collections::BTreeMap<String, (String, String, Vec<usize>, usize)>,
    Vec<serde_json::Map<String, Value>>,
) {
    use std::io::Read;
    let mut tensors = std::collections::BTreeMap::new();
    let mut metadata = Vec::new();
    for file in hf::weight_files(dir).unwrap() {
        let mut f = std::fs::File::open(&file).unwrap();
        let mut len = [0u8; 8];
        f.read_exact(&mut len).unwrap();
        let mut header = vec![0u8; u64::from_le_bytes(len) as usize];
        f.read_exact(&mut header).unwrap();
        let header: serde_json::Map<String, Value> = serde_json::from_slice(&header).unwrap();
        let name = file.file_name().unwrap().to_str().unwrap().to_string();
        for (k, v) in header {
            if k == "__metadata__" {
                metadata.push(v.as_object().unwrap().clone());
                continue;
            }
            let shape: Vec<usize> = v["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize)
                .collect();
            let offsets = v["data_offsets"].as_array().unwrap();
            let bytes = (offsets[1].as_u64().unwrap() - offsets[0].as_u64().unwrap()) as usize;
            let dtype = v["dtype"].as_str().unwrap().to_string();
            tensors.insert(k, (name.clone(), dtype, shape, bytes));
        }
    }
    (tensors, metadata)
}

/// `export.format = "hf"` writes a directory `transformers` loads: the fixture's tensor names,
/// shapes and dtypes, metadata `format = "pt"`, the tied head left out, shards with an index
/// past `export.shard_mb`, the checkpoint's config and tokenizer; read back by kiln it gives
/// the run's own model's logits bit for bit; a LoRA run's PEFT adapters (the Llama's Linears,
/// GPT-2's `Conv1D`s with `fan_in_fan_out`) fold into the merged export. The test leaves
/// `reference.json` (the prompt's ids and the run's logits) in each directory, so that with
/// `KILN_KEEP_TEST_DIRS=1` (a passing test's directory kept) `xtask/reference/hf_fixtures.py
/// --check DIR` loads it in `transformers` (or the adapters in `peft`) and compares.
#[test]
fn the_hf_export_has_the_checkpoints_layout_and_the_runs_logits() {
    use burn::store::{ModuleSnapshot, SafetensorsStore};
    let dir = crate::common::temp_dir("hf-export");
    for (name, extra, shards) in [
        (
            "llama",
            vec![
                "finetune.lora.rank=4",
                "finetune.lora.alpha=8.0",
                "finetune.lora.targets=[\"**.q_proj\", \"**.down_proj\"]",
                "export.shard_mb=0.05",
                "export.adapters=true",
            ],
            7,
        ),
        ("gpt2", vec![], 1),
        // Phi-3's fused projections, adapted whole.
        (
            "phi3",
            vec![
                "finetune.lora.rank=4",
                "finetune.lora.alpha=8.0",
                "finetune.lora.targets=[\"**.qkv_proj\", \"**.gate_up_proj\"]",
                "export.adapters=true",
            ],
            1,
        ),
        // GPT-2's `Conv1D` keeps `[in, out]` weights: its PEFT adapters say `fan_in_fan_out`.
        (
            "gpt2-lora",
            vec![
                "finetune.lora.rank=4",
                "finetune.lora.alpha=8.0",
                "finetune.lora.targets=[\"**.c_attn\", \"**.mlp.c_proj\"]",
                "export.adapters=true",
            ],
            1,
        ),
    ] {
        let (label, name) = (name, name.trim_end_matches("-lora"));
        let mut all = vec![
            "export.format=\"hf\"",
            "train.max_steps=4",
            "train.checkpoint_every=4",
        ];
        all.extend(extra);
        let r = kiln::builtin::train(
            &hf_config(&dir, label, name, &all),
            &kiln::run::RunOptions::default(),
        )
        .unwrap();
        let out = r.dir.join("hf");
        let (got, meta) = layout(&out);
        let (want, _) = layout(&fixture(name));
        let strip =
            |m: &std::collections::BTreeMap<String, (String, String, Vec<usize>, usize)>| {
                m.iter()
                    .map(|(k, (_, d, s, _))| (k.clone(), d.clone(), s.clone()))
                    .collect::<Vec<_>>()
            };
        assert_eq!(strip(&got), strip(&want), "{name}: names, dtypes, shapes");
        assert_eq!(meta.len(), shards, "{name}: files");
        for m in &meta {
            assert_eq!(m.get("format"), Some(&Value::from("pt")), "{name}: {m:?}");
        }
        if shards > 1 {
            let index: Value = serde_json::from_str(
                &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
            )
            .unwrap();
            let map = index["weight_map"].as_object().unwrap();
            assert_eq!(map.len(), got.len(), "{name}: index");
            for (k, (file, _, _, _)) in &got {
                assert_eq!(map[k].as_str(), Some(file.as_str()), "{name}: {k}");
            }
            let total: usize = got.values().map(|v| v.3).sum();
            assert_eq!(index["metadata"]["total_size"].as_u64(), Some(total as u64));
        } else {
            assert!(!out.join("model.safetensors.index.json").exists());
        }
        // The checkpoint's config (as f32) and tokenizer.
        assert_eq!(
            format!("{:?}", hf::read_config(&out).unwrap()),
            format!("{:?}", hf::read_config(&fixture(name)).unwrap()),
        );
        assert_eq!(
            std::fs::read(out.join("tokenizer.json")).unwrap(),
            std::fs::read(fixture(name).join("tokenizer.json")).unwrap()
        );
        // Read back by kiln: the run's model (its own layout, adapters folded), bit for bit.
        let ids = reference(&fixture(name)).ids;
        let exported = Lm::load(&out).forward(&ids);
        let mut store = SafetensorsStore::from_file(r.dir.join("model.safetensors"));
        let device = Device::flex();
        let s = hf::read_config(&out).unwrap();
        // Each init under the random-number lock (see `with_rng`): its draws stay out of a
        // seeded run's beside it.
        let run = match s.kind {
            ModelKind::Llama => {
                let mut m = kiln_models::with_rng(|| s.llama.init(&device));
                m.load_from(&mut store).unwrap();
                Lm::Llama(m)
            }
            ModelKind::Phi3 => {
                let mut m = kiln_models::with_rng(|| s.phi3.init(&device));
                m.load_from(&mut store).unwrap();
                Lm::Phi3(m)
            }
            _ => {
                let mut m = kiln_models::with_rng(|| s.gpt2.init(&device));
                m.load_from(&mut store).unwrap();
                Lm::Gpt2(m)
            }
        };
        let ours: Vec<f32> = run.forward(&ids).into_data().try_to_vec().unwrap();
        let back: Vec<f32> = exported.into_data().try_to_vec().unwrap();
        assert_eq!(ours, back, "{name}: logits of the export read back");
        let theirs = reference(&fixture(name)).logits;
        assert!(
            ours.iter().zip(&theirs).any(|(a, b)| a != b),
            "{name}: the run trained nothing"
        );
        let reference = serde_json::json!({"ids": ids, "logits": ours});
        std::fs::write(out.join("reference.json"), reference.to_string()).unwrap();
        if r.dir.join("hf-adapter").exists() {
            let merged = (1..=shards)
                .map(|i| match shards {
                    1 => out.join("model.safetensors"),
                    n => out.join(format!("model-{i:05}-of-{n:05}.safetensors")),
                })
                .collect::<Vec<_>>();
            peft_adapters_fold_into_the_export(&r.dir, &fixture(name), &merged, 8.0 / 4.0);
            std::fs::write(
                r.dir.join("hf-adapter/reference.json"),
                reference.to_string(),
            )
            .unwrap();
        }
        println!(
            "{name}: {} tensors in {shards} file(s), {}",
            got.len(),
            out.display()
        );
    }
}

/// The PEFT adapters of a run (`hf-adapter/`): `lora_A [r, in]` and `lora_B [out, r]` of each
/// adapted module, and the checkpoint's weight plus `scale · B A` is the exported merged one
/// (`merged`, its files) — transposed, `scale · (B A)ᵀ`, on GPT-2's `[in, out]` `Conv1D`
/// weights, whose adapter config says `fan_in_fan_out` as `peft` needs it.
fn peft_adapters_fold_into_the_export(run: &Path, base: &Path, merged: &[PathBuf], scale: f32) {
    use kiln::weights::read_tensors;
    let adapters = read_tensors(&run.join("hf-adapter/adapter_model.safetensors")).unwrap();
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(run.join("hf-adapter/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["r"], 4);
    assert_eq!(config["peft_type"], "LORA");
    let original = read_tensors(&base.join("model.safetensors")).unwrap();
    let conv1d = original.keys().any(|k| k.contains(".c_attn."));
    assert_eq!(config["fan_in_fan_out"], conv1d, "{}", base.display());
    let mut weights = std::collections::BTreeMap::new();
    for f in merged {
        weights.extend(read_tensors(f).unwrap());
    }
    let merged = weights;
    assert_eq!(adapters.len(), 2 * 2 * 2, "A and B of 2 targets × 2 layers");
    for (key, (shape_a, a)) in adapters
        .iter()
        .filter(|(k, _)| k.ends_with("lora_A.weight"))
    {
        let module = key
            .strip_prefix("base_model.model.")
            .unwrap()
            .strip_suffix(".lora_A.weight")
            .unwrap();
        let (shape_b, b) = &adapters[&format!("base_model.model.{module}.lora_B.weight")];
        let weight = format!("{module}.weight");
        let (shape_w, w) = &original[&weight];
        // `[out, in]` (Linear) or `[in, out]` (Conv1D); `at(o, i)` is the element's index.
        let (out, inp) = if conv1d {
            (shape_w[1], shape_w[0])
        } else {
            (shape_w[0], shape_w[1])
        };
        let at = |o: usize, i: usize| if conv1d { i * out + o } else { o * inp + i };
        let r = shape_a[0];
        assert_eq!(
            (shape_a.as_slice(), shape_b.as_slice()),
            (&[r, inp][..], &[out, r][..])
        );
        let m = &merged[&weight].1;
        let mut worst = 0.0f32;
        for o in 0..out {
            for i in 0..inp {
                let delta: f32 = (0..r).map(|k| b[o * r + k] * a[k * inp + i]).sum();
                let want = w[at(o, i)] + scale * delta;
                worst = worst.max((m[at(o, i)] - want).abs());
            }
        }
        let moved = m
            .iter()
            .zip(w)
            .fold(0.0f32, |x, (p, q)| x.max((p - q).abs()));
        assert!(
            worst < 1e-6 && moved > 1e-4,
            "{module}: off by {worst}, moved {moved}"
        );
    }
}
