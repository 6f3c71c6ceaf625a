//! Fine-tuning on one's own examples: chat templates rendered and tokenized as `transformers`'
//! `apply_chat_template` does, and the loss on the answers alone as `transformers` computes it
//! with labels -100 elsewhere — on the fixtures `xtask/reference/chat_fixtures.py` made with
//! `transformers` (`tests/fixtures/chat`).

use std::path::{Path, PathBuf};

use burn::prelude::*;
use kiln_datasets::chat::{ChatTemplate, Message, TrainOn, encode};
use kiln_datasets::subword::SubwordTokenizer;
use kiln_models::hf;
use kiln_models::{Gpt2, IGNORE, Llama, TokenBatch, TrainStep};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/chat")
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn messages(v: &Value) -> Vec<Message> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect()
}

fn ids(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

#[test]
fn three_chat_templates_give_the_token_ids_transformers_gives_on_50_conversations() {
    let dir = fixtures();
    let tokenizer = SubwordTokenizer::load(&dir.join("tokenizer.json")).unwrap();
    let reference = json(&dir.join("reference.json"));
    let conversations: Vec<Vec<Message>> = std::fs::read_to_string(dir.join("conversations.jsonl"))
        .unwrap()
        .lines()
        .map(|l| messages(&serde_json::from_str::<Value>(l).unwrap()["messages"]))
        .collect();
    assert_eq!(conversations.len(), 50);
    let mut checked = 0;
    for name in ["turns", "headers", "inst"] {
        let template = ChatTemplate::of_checkpoint(&dir.join(name))
            .unwrap()
            .expect("a template");
        let rows = reference[name].as_array().unwrap();
        for (i, (conversation, row)) in conversations.iter().zip(rows).enumerate() {
            let generation = row["generation"].as_bool().unwrap();
            let rendered = template.render(conversation, generation);
            if let Some(error) = row.get("error") {
                // transformers' template raised: so does kiln's, with its message.
                let e = rendered.expect_err("transformers refused this conversation");
                let said = error.as_str().unwrap();
                assert!(e.contains(said), "{name} #{i}: {e} does not say {said:?}");
                continue;
            }
            let text = rendered.unwrap_or_else(|e| panic!("{name} #{i}: {e}"));
            let got: Vec<i64> = tokenizer
                .encode(&text)
                .unwrap()
                .into_iter()
                .map(i64::from)
                .collect();
            assert_eq!(got, ids(&row["ids"]), "{name}, conversation {i}");
            checked += 1;
        }
    }
    // 150 renders, two of which the inst template refuses (roles that do not alternate).
    assert_eq!(checked, 148);
}

#[test]
fn the_loss_on_the_answers_alone_is_transformers_loss_with_labels_minus_100() {
    let dir = fixtures().join("llama-chat");
    let reference = json(&dir.join("reference.json"));
    let tokenizer = SubwordTokenizer::load(&dir).unwrap();
    let template = ChatTemplate::of_checkpoint(&dir)
        .unwrap()
        .expect("a template");
    let device = Device::flex();
    let config = hf::read_config(&dir)
        .unwrap()
        .config_of::<Llama>()
        .unwrap()
        .clone();
    let model = hf::load::<Llama>(&dir, &config, &device).unwrap().0;
    let rows = reference["conversations"].as_array().unwrap();
    let mut batch = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let encoded = encode(
            &template,
            &tokenizer,
            &messages(&row["messages"]),
            TrainOn::Responses,
        )
        .unwrap();
        let want = ids(&row["ids"]);
        let labels = ids(&row["labels"]);
        let got: Vec<i64> = encoded.ids.iter().map(|&x| i64::from(x)).collect();
        assert_eq!(got, want, "conversation {i}: ids");
        // The answers kiln marks are the tokens transformers' labels keep.
        let marked: Vec<bool> = labels.iter().map(|&l| l != -100).collect();
        assert_eq!(encoded.trained, marked, "conversation {i}: the answers");
        // Next-token targets: the label of the following position.
        let n = got.len() - 1;
        let targets: Vec<i64> = labels[1..]
            .iter()
            .map(|&l| if l == -100 { IGNORE } else { l })
            .collect();
        let one = TokenBatch::new(
            Tensor::from_data(TensorData::new(got[..n].to_vec(), [1, n]), &device),
            Tensor::from_data(TensorData::new(targets.clone(), [1, n]), &device),
        );
        let loss = model.step(one).loss.into_scalar::<f32>();
        let expected = row["loss"].as_f64().unwrap();
        assert!(
            (f64::from(loss) - expected).abs() <= 1e-5 * expected.abs().max(1.0),
            "conversation {i}: kiln {loss}, transformers {expected}"
        );
        batch.push((got[..n].to_vec(), targets));
    }
    // The six as one batch padded on the right: the padding has no loss, and (the attention
    // being causal) no real position sees it.
    let longest = batch.iter().map(|(x, _)| x.len()).max().unwrap();
    let (mut inputs, mut targets) = (Vec::new(), Vec::new());
    for (x, t) in &batch {
        inputs.extend(
            x.iter()
                .copied()
                .chain(std::iter::repeat_n(385, longest - x.len())),
        );
        targets.extend(
            t.iter()
                .copied()
                .chain(std::iter::repeat_n(IGNORE, longest - t.len())),
        );
    }
    let b = batch.len();
    let padded = TokenBatch::new(
        Tensor::from_data(TensorData::new(inputs, [b, longest]), &device),
        Tensor::from_data(TensorData::new(targets, [b, longest]), &device),
    );
    let loss = f64::from(model.step(padded).loss.into_scalar::<f32>());
    let expected = reference["batch_loss"].as_f64().unwrap();
    assert!(
        (loss - expected).abs() <= 1e-5 * expected,
        "the padded batch: kiln {loss}, transformers {expected}"
    );
}

#[test]
fn a_prompt_tokens_logit_gets_no_gradient() {
    // The loss's gradient at the logits of every position whose target is ignored is exactly
    // zero, on the Llama fixture's own logits.
    let dir = fixtures().join("llama-chat");
    let reference = json(&dir.join("reference.json"));
    let device = Device::flex().autodiff();
    let config = hf::read_config(&dir)
        .unwrap()
        .config_of::<Llama>()
        .unwrap()
        .clone();
    let model = hf::load::<Llama>(&dir, &config, &device).unwrap().0;
    let row = &reference["conversations"][0];
    let got = ids(&row["ids"]);
    let labels = ids(&row["labels"]);
    let n = got.len() - 1;
    let logits = kiln_models::CausalLm::logits(
        &model,
        Tensor::from_data(TensorData::new(got[..n].to_vec(), [1, n]), &device),
    )
    .detach()
    .require_grad();
    let targets: Vec<i64> = labels[1..].to_vec();
    let loss = kiln_models::lm::lm_loss(
        logits.clone(),
        Tensor::from_data(TensorData::new(targets.clone(), [1, n]), &device),
    );
    let grads = loss.backward();
    let g: Vec<f32> = logits
        .grad(&grads)
        .unwrap()
        .into_data()
        .try_to_vec()
        .unwrap();
    let v = g.len() / n;
    let (mut prompt, mut answer) = (0, 0);
    for (p, &t) in targets.iter().enumerate() {
        let row = &g[p * v..(p + 1) * v];
        if t == IGNORE {
            assert!(
                row.iter().all(|&d| d == 0.0),
                "position {p} is the prompt's"
            );
            prompt += 1;
        } else {
            assert!(row.iter().any(|&d| d != 0.0), "position {p} is an answer's");
            answer += 1;
        }
    }
    assert!(
        prompt > 10 && answer > 10,
        "{prompt} prompt and {answer} answer positions"
    );
}

/// A JSONL file of `n` prompt-and-answer records of varied lengths (Alpaca's fields), and
/// `bad` lines after them that do not parse.
pub(crate) fn pairs_file(dir: &Path, n: usize, bad: usize) -> PathBuf {
    let words = [
        "whale", "sea", "ship", "captain", "harpoon", "ocean", "sail", "storm",
    ];
    let mut text = String::new();
    for i in 0..n {
        let (a, b) = (words[i % 8], words[(i * 3 + 1) % 8]);
        let long = " and the sea beyond".repeat(i % 5);
        let record = serde_json::json!({
            "instruction": format!("Which comes first{long}, {a} or {b}?"),
            "input": if i % 3 == 0 { "alphabetically" } else { "" },
            "output": a.min(b),
        });
        text += &format!("{record}\n");
    }
    for _ in 0..bad {
        text += "{\"instruction\": \n";
    }
    let path = dir.join("pairs.jsonl");
    std::fs::write(&path, text).unwrap();
    path
}

/// A fine-tune of the chat fixture on `data`: 6 steps of 8 examples, LoRA on the attention's
/// q and v and the MLP's down projection.
fn instruct(dir: &Path, name: &str, data: &Path, extra: &[&str]) -> kiln::run::RunResult {
    let from = fixtures().join("llama-chat").display().to_string();
    let mut o: Vec<String> = vec![
        "model.kind=\"hf\"".into(),
        format!("init.from={from:?}"),
        "data.dataset=\"instruct\"".into(),
        format!("data.path={:?}", data.display().to_string()),
        "train.max_steps=6".into(),
        "train.epochs=0".into(),
        "train.batch_size=8".into(),
        "train.log_every=3".into(),
        "optim.lr=0.01".into(),
        "finetune.lora.rank=4".into(),
        "finetune.lora.alpha=8.0".into(),
        "finetune.lora.targets=[\"**.q_proj\", \"**.v_proj\", \"**.down_proj\"]".into(),
        format!("run.dir={:?}", dir.join(name).display().to_string()),
    ];
    o.extend(extra.iter().map(|s| s.to_string()));
    let config = kiln::builtin::load(None, &o).unwrap();
    kiln::builtin::train(&config, &kiln::run::RunOptions::default()).unwrap()
}

#[test]
fn instruct_fine_tuning_gives_one_devices_adapters_on_two_under_ddp_and_zero3() {
    use crate::finetune::{pick, values};
    let dir = crate::common::temp_dir("chat-instruct");
    let data = pairs_file(&dir, 60, 0);
    let adapters = |r: &kiln::run::RunResult| {
        let path = r.dir.join("checkpoints/step-00000006/model.bpk");
        let t = kiln::weights::read_tensors(&path).unwrap();
        pick(&t, |k| k.contains(".lora."))
    };
    let ck = ["train.checkpoint_every=6"];
    let one = instruct(&dir, "one", &data, &ck);
    let one_ad = adapters(&one);
    assert_eq!(one_ad.len(), 2 * 3 * 2, "A and B of 3 targets in 2 layers");
    // The loss fell, on answers alone: the log counts the trained tokens (a handful per
    // example), not the prompts'.
    let train = crate::common::metrics(&one.dir, "train");
    let loss = |r: &serde_json::Value| r["loss"].as_f64().unwrap();
    assert!(loss(&train[1]) < loss(&train[0]), "{train:?}");
    let val = crate::common::metrics(&one.dir, "val");
    assert!(!val.is_empty());
    for strategy in ["ddp", "zero3"] {
        let s = format!("strategy.name={strategy:?}");
        let two = instruct(
            &dir,
            strategy,
            &data,
            &[ck[0], &s, "train.batch_size=4", "hardware.devices=2"],
        );
        let diff = crate::common::max_relative_diff(&values(&one_ad), &values(&adapters(&two)));
        assert!(diff < 1e-5, "{strategy} on 2 devices against one: {diff:e}");
        // The step's loss is the mean over all its trained tokens, however they are split.
        let l2 = crate::common::metrics(&two.dir, "train");
        for (a, b) in train.iter().zip(&l2) {
            assert!(
                (loss(a) - loss(b)).abs() < 1e-5 * loss(a),
                "{a} against {b}"
            );
        }
    }
}

/// Each device's loss is weighted by its share of the step's trained tokens: one SGD step
/// on 16 examples, half with a one-word answer and half with a long one (the step sorts them
/// by length, so under ddp one device holds the short answers and the other the long), gives
/// on two devices the adapters of one device that runs the 16 as one batch. An unweighted
/// mean of the two devices' means would give the few short answers' tokens as much say as
/// the many long ones'.
#[test]
fn a_step_weighs_each_devices_loss_by_its_trained_tokens() {
    use crate::finetune::{pick, values};
    let dir = crate::common::temp_dir("chat-weights");
    let mut text = String::new();
    for i in 0..16 {
        let output = if i % 2 == 0 {
            "whale".to_string()
        } else {
            "the whale and the ship and the sea and the storm beyond the captain".repeat(2)
        };
        let record = serde_json::json!({"instruction": format!("Say {i}"), "output": output});
        text += &format!("{record}\n");
    }
    let data = dir.join("uneven.jsonl");
    std::fs::write(&data, text).unwrap();
    let adapters = |r: &kiln::run::RunResult| {
        let path = r.dir.join("checkpoints/step-00000001/model.bpk");
        let t = kiln::weights::read_tensors(&path).unwrap();
        pick(&t, |k| k.contains(".lora."))
    };
    // Every record trains (the same file validates).
    let eval = format!("data.eval_path={:?}", data.display().to_string());
    let step = [
        "train.max_steps=1",
        "train.checkpoint_every=1",
        "optim.name=\"sgd\"",
        "optim.lr=0.5",
        eval.as_str(),
    ];
    // One replica with the whole batch: no per-core split.
    let whole = ["train.batch_size=16", "hardware.cpu_split=\"off\""];
    let one = instruct(&dir, "one", &data, &[&step[..], &whole].concat());
    let split = [
        "train.batch_size=8",
        "hardware.devices=2",
        "strategy.name=\"ddp\"",
    ];
    let two = instruct(&dir, "ddp", &data, &[&step[..], &split].concat());
    let (a, b) = (values(&adapters(&one)), values(&adapters(&two)));
    // B starts at zero: a value off zero in every tensor says the step moved them.
    assert!(a.iter().all(|t| t.iter().any(|&v| v != 0.0)), "{a:?}");
    let diff = crate::common::max_relative_diff(&a, &b);
    assert!(diff < 1e-5, "ddp on 2 devices against one: {diff:e}");
}

/// Packed examples under what the rest of kiln offers, on the fixture checkpoint with LoRA:
/// recompute gives the adapters of no recompute bit for bit; bf16-mixed under zero2, DiLoCo's
/// islands, QLoRA's 8-bit base in f32 and its 4-bit base under bf16-mixed each train to a
/// finite validation loss (on the answers) below the checkpoint's; `train plan` plans the run.
#[test]
fn packed_examples_take_recompute_mixed_precision_diloco_qlora_and_the_planner() {
    let dir = crate::common::temp_dir("chat-modes");
    let data = pairs_file(&dir, 60, 0);
    let packed = ["data.pack=true", "data.context=256"];
    let from = fixtures().join("llama-chat").display().to_string();
    let start = {
        let sets: Vec<String> = [
            "model.kind=\"hf\"".to_string(),
            format!("init.from={from:?}"),
            "data.dataset=\"instruct\"".into(),
            format!("data.path={:?}", data.display().to_string()),
            format!("run.dir={:?}", dir.join("start").display().to_string()),
        ]
        .into_iter()
        .chain(packed.iter().map(|s| s.to_string()))
        .collect();
        let config = kiln::builtin::load(None, &sets).unwrap();
        let options = kiln::run::RunOptions {
            evaluate: true,
            ..Default::default()
        };
        let r = kiln::builtin::train(&config, &options).unwrap();
        r.summary.val_loss.unwrap()
    };
    let two = ["hardware.devices=2", "train.batch_size=4"];
    let mut adapters = Vec::new();
    for (label, extra) in [
        ("plain", vec![]),
        ("recompute", vec!["recompute.mode=\"blocks\""]),
        (
            "bf16-zero2",
            vec![
                "precision.mode=\"bf16-mixed\"",
                "strategy.name=\"zero2\"",
                two[0],
                two[1],
            ],
        ),
        (
            "diloco",
            vec![
                "strategy.name=\"diloco\"",
                "diloco.inner_steps=2",
                two[0],
                two[1],
            ],
        ),
        ("qlora-q8", vec!["finetune.lora.quantize=\"q8\""]),
        (
            "qlora-q4-bf16",
            vec![
                "finetune.lora.quantize=\"q4\"",
                "precision.mode=\"bf16-mixed\"",
            ],
        ),
    ] {
        let mut all = vec!["train.checkpoint_every=6", packed[0], packed[1]];
        all.extend(extra);
        let r = instruct(&dir, label, &data, &all);
        let val = r.summary.val_loss.unwrap();
        assert!(
            val.is_finite() && val < start,
            "{label}: {val} from {start}"
        );
        if label == "plain" || label == "recompute" {
            adapters.push(kiln::weights::read_tensors(&r.dir.join("model.safetensors")).unwrap());
        }
    }
    assert_eq!(adapters[0], adapters[1], "recompute changed the parameters");
    let out = crate::common::train_bin(
        &dir,
        &[
            "plan",
            "--json",
            "--devices",
            "2",
            "--batch-size",
            "8",
            "--set",
            "model.kind=\"hf\"",
            "--set",
            &format!("init.from={from:?}"),
            "--set",
            "data.dataset=\"instruct\"",
            "--set",
            &format!("data.path={:?}", data.display().to_string()),
            "--set",
            packed[0],
            "--set",
            packed[1],
            "--set",
            "finetune.lora.targets=[\"**.q_proj\"]",
        ],
    );
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for s in ["\"ddp\"", "\"zero3\"", "\"pipeline 2×2 1f1b\""] {
        assert!(said.contains(s), "{s} not planned: {said}");
    }
}

#[test]
fn bad_records_are_named_by_file_and_line_and_too_many_refuse_the_run() {
    let dir = crate::common::temp_dir("chat-bad");
    let from = fixtures().join("llama-chat").display().to_string();
    let base = |data: &Path, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = ["--set", "model.kind=\"hf\"", "--set"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        a.push(format!("init.from={from:?}"));
        for s in [
            "data.dataset=\"instruct\"".to_string(),
            format!("data.path={:?}", data.display().to_string()),
            "train.max_steps=1".into(),
            format!("run.dir={:?}", dir.join("run").display().to_string()),
        ]
        .into_iter()
        .chain(extra.iter().map(|s| s.to_string()))
        {
            a.push("--set".into());
            a.push(s);
        }
        a
    };
    let run = |args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        crate::common::train_bin(&dir, &args)
    };
    // Two lines of 42 that do not parse: over the default 1 %.
    let data = pairs_file(&dir, 40, 2);
    let file = data.display().to_string();
    let out = run(base(&data, &[]));
    crate::common::assert_one_line_error(
        &out,
        &[
            &format!("{file}:41: does not parse as JSON"),
            "2 of 42 records",
            "data.max_dropped",
        ],
    );
    // Allowed at 5 %: the run says which it set aside, and trains.
    let out = run(base(&data, &["data.max_dropped=0.05"]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(&format!("{file}:42: does not parse")),
        "{stdout}"
    );
    // A record without its answer; a role no template knows; a template that refuses the
    // conversation (two user turns in a row); an example longer than the context, dropped.
    let chat = dir.join("chat.jsonl");
    let turn = |r: &str, c: &str| serde_json::json!({"role": r, "content": c});
    let lines = [
        serde_json::json!({"messages": [turn("user", "hi"), turn("assistant", "hello")]}),
        serde_json::json!({"messages": [turn("user", "hi"), turn("bot", "hello")]}),
    ];
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(&chat, text).unwrap();
    let out = run(base(&chat, &["data.dataset=\"chat\""]));
    crate::common::assert_one_line_error(
        &out,
        &[&format!(
            "{}:2: turn 1 of `messages`: role \"bot\"",
            chat.display()
        )],
    );
    let out = run(base(&data, &["data.fields.response=\"answer\""]));
    crate::common::assert_one_line_error(&out, &[&format!("{file}:1: no field `answer`")]);
    let inst = fixtures().join("inst").display().to_string();
    let two_users = dir.join("two.jsonl");
    let l = serde_json::json!({"messages": [turn("user", "a"), turn("user", "b"), turn("assistant", "c")]});
    std::fs::write(&two_users, format!("{}\n{l}\n", lines[0])).unwrap();
    // The inst template with the fixture's tokenizer, in a directory of their own.
    let tdir = dir.join("inst");
    std::fs::create_dir_all(&tdir).unwrap();
    std::fs::copy(
        format!("{inst}/tokenizer_config.json"),
        tdir.join("tokenizer_config.json"),
    )
    .unwrap();
    std::fs::copy(
        fixtures().join("tokenizer.json"),
        tdir.join("tokenizer.json"),
    )
    .unwrap();
    let tset = format!("data.tokenizer={:?}", tdir.display().to_string());
    let out = run(base(&two_users, &["data.dataset=\"chat\"", &tset]));
    crate::common::assert_one_line_error(
        &out,
        &[
            &format!("{}:2:", two_users.display()),
            "Conversation roles must alternate",
        ],
    );
    let clean_dir = dir.join("clean");
    std::fs::create_dir_all(&clean_dir).unwrap();
    let clean = pairs_file(&clean_dir, 40, 0);
    let out = run(base(&clean, &["data.context=12", "data.overlong=\"drop\""]));
    crate::common::assert_one_line_error(
        &out,
        &[
            &format!("{}:", clean.display()),
            "longer than the context + 1 = 13",
        ],
    );
    // Truncated before its answer, an example has nothing to train on: set aside too.
    let out = run(base(&clean, &["data.context=12"]));
    crate::common::assert_one_line_error(
        &out,
        &[
            &format!("{}:", clean.display()),
            "longer than the context + 1 = 13, and no token it trains on within them",
        ],
    );
}

#[test]
fn a_fine_tuned_run_answers_a_prompt_and_holds_a_conversation() {
    let dir = crate::common::temp_dir("chat-talk");
    let data = pairs_file(&dir, 40, 0);
    let run = instruct(&dir, "run", &data, &["train.max_steps=2"]);
    let r = run.dir.display().to_string();
    let out = crate::common::train_bin(
        &dir,
        &[
            "sample",
            "--run",
            &r,
            "--prompt",
            "Which comes first, sea or ship?",
            "--temperature",
            "0",
            "--tokens",
            "12",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let answer = String::from_utf8_lossy(&out.stdout).trim_end().to_string();
    // The answer alone: the template's turn markers are not in it, and it stopped at the
    // end-of-turn token or after 12 tokens.
    assert!(
        !answer.contains("<|im_start|>") && !answer.contains("Which comes"),
        "{answer:?}"
    );
    let talker = kiln::builtin::talk::Talker::open(&run.dir).unwrap();
    let how = kiln_models::Sampling {
        stop: vec![385],
        ..kiln_models::Sampling::greedy()
    };
    let turn = [Message::new("user", "Which comes first, sea or ship?")];
    assert_eq!(talker.answer(&turn, 12, &how, 1).unwrap(), answer);
    // `train chat`: a turn per line, each answered in the context of the ones before.
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
        .args(["chat", "--run", &r, "--temperature", "0", "--tokens", "12"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"Which comes first, sea or ship?\nAnd whale or storm?\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let said = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = said.lines().collect();
    assert_eq!(lines.len(), 2, "{said:?}");
    assert_eq!(lines[0], answer);
    let second = [
        turn_of("user", "Which comes first, sea or ship?"),
        turn_of("assistant", lines[0]),
        turn_of("user", "And whale or storm?"),
    ];
    assert_eq!(talker.answer(&second, 12, &how, 2).unwrap(), lines[1]);
}

/// `train answer` asks a run each record's prompt greedily and counts the answers equal to
/// the record's: records whose expected answer is the run's own answer count, the others do
/// not; a run on text (no chat template) is asked in kiln's plain format.
#[test]
fn train_answer_counts_the_greedy_answers_equal_to_the_records() {
    let dir = crate::common::temp_dir("chat-answer");
    let data = pairs_file(&dir, 40, 0);
    let run = instruct(&dir, "run", &data, &["train.max_steps=2"]);
    let talker = kiln::builtin::talk::Talker::open(&run.dir).unwrap();
    let how = kiln_models::Sampling {
        stop: vec![385],
        ..kiln_models::Sampling::greedy()
    };
    // Six records: the first three expect what the run answers, the last three something else.
    let mut text = String::new();
    let mut expected = Vec::new();
    for i in 0..6 {
        let prompt = format!("Which comes first, sea or ship number {i}?");
        let said = talker
            .answer(&[Message::new("user", &prompt)], 16, &how, 1)
            .unwrap();
        let output = if i < 3 {
            said.clone()
        } else {
            format!("not {said}")
        };
        expected.push((said, i < 3));
        text += &format!(
            "{}\n",
            serde_json::json!({"prompt": prompt, "completion": output})
        );
    }
    let asked = dir.join("asked.jsonl");
    std::fs::write(&asked, text).unwrap();
    let out_file = dir.join("answers.jsonl");
    let answer = |run: &Path, extra: &[&str]| {
        let (r, a) = (run.display().to_string(), asked.display().to_string());
        let mut args = vec!["answer", "--run", &r, "--data", &a, "--tokens", "16"];
        args.extend_from_slice(extra);
        crate::common::train_bin(&dir, &args)
    };
    let o = out_file.display().to_string();
    let out = answer(&run.dir, &["--out", &o, "--parts", " "]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("exact match  3 of 6 (50.0 %)"), "{said}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&out_file)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 6);
    for (line, (said, exact)) in lines.iter().zip(&expected) {
        assert_eq!(line["answer"].as_str().unwrap(), said.trim(), "{line}");
        assert_eq!(line["exact"].as_bool().unwrap(), *exact, "{line}");
    }
    // Part 1 (the first word): equal in the three exact answers, and in none of the others
    // (their expected first word is "not").
    let firsts = lines
        .iter()
        .filter(|l| {
            let first = |k: &str| l[k].as_str().unwrap().split(' ').next().map(str::to_string);
            first("answer") == first("expected")
        })
        .count();
    assert_eq!(firsts, 3);
    assert!(said.contains("part 1       3 of 6"), "{said}");
    // A run on text, without a chat template: asked in the plain format, ended by the
    // vocabulary's <|endoftext|>.
    let from = fixtures().join("llama-chat").display().to_string();
    let corpus = dir.join("corpus.txt");
    std::fs::write(&corpus, "the whale and the sea and the ship. ".repeat(200)).unwrap();
    let sets = [
        "model.kind=\"hf\"".to_string(),
        format!("init.from={from:?}"),
        format!("data.tokenizer={from:?}"),
        "data.dataset=\"text\"".into(),
        format!("data.path={:?}", corpus.display().to_string()),
        "data.context=16".into(),
        "train.max_steps=1".into(),
        "train.epochs=0".into(),
        "train.batch_size=4".into(),
        format!("run.dir={:?}", dir.join("base").display().to_string()),
    ];
    let config = kiln::builtin::load(None, &sets).unwrap();
    let base = kiln::builtin::train(&config, &kiln::run::RunOptions::default()).unwrap();
    let out = answer(&base.dir, &["--limit", "2"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains(": 2 records"), "{said}");
    // A file that is not there is named.
    let out = crate::common::train_bin(
        &dir,
        &[
            "answer",
            "--run",
            &run.dir.display().to_string(),
            "--data",
            "missing.jsonl",
        ],
    );
    crate::common::assert_one_line_error(&out, &["missing.jsonl", "no such file"]);
}

fn turn_of(role: &str, content: &str) -> Message {
    Message::new(role, content)
}

/// Every float parameter's gradient in `grads`, in the module's order.
fn gradients<M: burn::module::Module>(model: &M, grads: &burn::tensor::Gradients) -> Vec<Vec<f32>> {
    struct Collect<'a> {
        grads: &'a burn::tensor::Gradients,
        out: Vec<Vec<f32>>,
    }
    impl burn::module::ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            if let Some(g) = param.val().grad(self.grads) {
                self.out.push(g.into_data().try_to_vec().unwrap());
            }
        }
    }
    let mut c = Collect {
        grads,
        out: Vec::new(),
    };
    model.visit(&mut c);
    c.out
}

/// Four examples (ids and next-token targets, some ignored) packed two to a row of `t`, the
/// rest of a row padding (its own document, no loss), against the four run one by one: the
/// loss (the mean over every trained target) and every parameter's gradient agree within
/// 1e-5 of their scale.
fn packed_equals_one_by_one<M>(model: &M, vocab: usize, name: &str)
where
    M: TrainStep<TokenBatch> + burn::module::Module,
{
    let device = Device::flex().autodiff();
    let lengths = [[7usize, 12], [16, 3]];
    let t = 21;
    let ids = |e: usize, n: usize| -> Vec<i64> {
        (0..n)
            .map(|i| ((e * 31 + i * 7 + 3) % vocab) as i64)
            .collect()
    };
    // Targets: the next id, the first third of each example ignored (its prompt).
    let targets = |e: usize, n: usize| -> Vec<i64> {
        (0..n)
            .map(|i| {
                if i < n / 3 {
                    IGNORE
                } else {
                    ((e * 17 + i * 5 + 1) % vocab) as i64
                }
            })
            .collect()
    };
    let (mut inputs, mut target_rows, mut starts) = (Vec::new(), Vec::new(), Vec::new());
    let mut alone = Vec::new();
    for (row, ls) in lengths.iter().enumerate() {
        let mut at = 0;
        for (k, &n) in ls.iter().enumerate() {
            let e = row * 2 + k;
            inputs.extend(ids(e, n));
            target_rows.extend(targets(e, n));
            starts.extend(std::iter::repeat_n(at as i64, n));
            alone.push((ids(e, n), targets(e, n)));
            at += n;
        }
        let pad = t - at;
        inputs.extend(std::iter::repeat_n(0, pad));
        target_rows.extend(std::iter::repeat_n(IGNORE, pad));
        starts.extend(std::iter::repeat_n(at as i64, pad));
    }
    let trained = |t: &[i64]| t.iter().filter(|&&x| x != IGNORE).count();
    let mut packed = TokenBatch::new(
        Tensor::from_data(TensorData::new(inputs, [2, t]), &device),
        Tensor::from_data(TensorData::new(target_rows.clone(), [2, t]), &device),
    );
    packed.documents = Some(Tensor::from_data(TensorData::new(starts, [2, t]), &device));
    let loss = model.step(packed).loss;
    let packed_loss = f64::from(loss.clone().into_scalar::<f32>());
    let packed_grads = gradients(model, &loss.backward());
    let total = trained(&target_rows) as f64;
    let (mut sum, mut grads): (f64, Vec<Vec<f32>>) = (0.0, Vec::new());
    for (x, y) in alone {
        let n = x.len();
        let w = trained(&y) as f64 / total;
        let one = TokenBatch::new(
            Tensor::from_data(TensorData::new(x, [1, n]), &device),
            Tensor::from_data(TensorData::new(y, [1, n]), &device),
        );
        let loss = model.step(one).loss;
        sum += w * f64::from(loss.clone().into_scalar::<f32>());
        let g = gradients(model, &loss.backward());
        if grads.is_empty() {
            grads = g.iter().map(|v| vec![0.0; v.len()]).collect();
        }
        for (acc, g) in grads.iter_mut().zip(g) {
            for (a, v) in acc.iter_mut().zip(g) {
                *a += (w as f32) * v;
            }
        }
    }
    assert!(
        (packed_loss - sum).abs() <= 1e-5 * sum,
        "{name}: packed {packed_loss}, one by one {sum}"
    );
    assert_eq!(packed_grads.len(), grads.len(), "{name}: gradients");
    let diff = crate::common::max_relative_diff(&packed_grads, &grads);
    assert!(diff < 1e-5, "{name}: gradients differ by {diff:e}");
}

#[test]
fn a_packed_batch_gives_the_loss_and_gradients_of_its_examples_one_by_one() {
    let device = Device::flex().autodiff();
    let dir = fixtures().join("llama-chat");
    let c = hf::read_config(&dir)
        .unwrap()
        .config_of::<Llama>()
        .unwrap()
        .clone();
    let llama = hf::load::<Llama>(&dir, &c, &device).unwrap().0;
    packed_equals_one_by_one(&llama, c.vocab_size, "llama");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/gpt2");
    let c = hf::read_config(&dir)
        .unwrap()
        .config_of::<Gpt2>()
        .unwrap()
        .clone();
    let gpt2 = hf::load::<Gpt2>(&dir, &c, &device).unwrap().0;
    packed_equals_one_by_one(&gpt2, c.vocab_size, "gpt2");
    let config = kiln_models::GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        block_size: 32,
        vocab_size: 50,
        dropout: 0.0,
        bias: true,
    };
    // Under the process's random-number lock: a draw outside it would move the shared state
    // under a run seeding its initial weights in a test beside this one.
    let gpt = kiln_models::with_rng(|| config.init(&device));
    packed_equals_one_by_one(&gpt, 50, "gpt");
}

#[test]
fn packed_fine_tuning_gives_one_devices_weights_under_ddp_zero3_and_a_three_stage_pipeline() {
    // kiln's GPT of three blocks on the chat fixtures' tokenizer and template (data.tokenizer),
    // the examples packed into rows of 128 tokens: a pipeline's middle stage runs its block
    // on the packed rows' documents too.
    let dir = crate::common::temp_dir("chat-packed");
    let data = pairs_file(&dir, 48, 0);
    let tok = fixtures().join("turns");
    let tdir = dir.join("tok");
    std::fs::create_dir_all(&tdir).unwrap();
    std::fs::copy(
        fixtures().join("tokenizer.json"),
        tdir.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::copy(
        tok.join("tokenizer_config.json"),
        tdir.join("tokenizer_config.json"),
    )
    .unwrap();
    let run = |name: &str, extra: &[&str]| {
        let mut o: Vec<String> = vec![
            "model.kind=\"gpt\"".into(),
            "model.gpt.n_layer=3".into(),
            "model.gpt.n_head=2".into(),
            "model.gpt.n_embd=32".into(),
            "model.gpt.block_size=128".into(),
            "data.dataset=\"instruct\"".into(),
            format!("data.path={:?}", data.display().to_string()),
            format!("data.tokenizer={:?}", tdir.display().to_string()),
            "data.pack=true".into(),
            "train.max_steps=4".into(),
            "train.epochs=0".into(),
            "train.batch_size=4".into(),
            "train.log_every=2".into(),
            "optim.lr=0.01".into(),
            format!("run.dir={:?}", dir.join(name).display().to_string()),
        ];
        o.extend(extra.iter().map(|s| s.to_string()));
        let config = kiln::builtin::load(None, &o).unwrap();
        let r = kiln::builtin::train(&config, &kiln::run::RunOptions::default()).unwrap();
        let t = kiln::weights::read_tensors(&r.dir.join("model.safetensors")).unwrap();
        crate::finetune::values(&crate::finetune::pick(&t, |_| true))
    };
    let one = run("one", &[]);
    for (name, extra) in [
        (
            "ddp",
            &[
                "strategy.name=\"ddp\"",
                "hardware.devices=2",
                "train.batch_size=2",
            ][..],
        ),
        (
            "zero3",
            &[
                "strategy.name=\"zero3\"",
                "hardware.devices=2",
                "train.batch_size=2",
            ],
        ),
        (
            "pipeline",
            &[
                "strategy.name=\"pipeline\"",
                "hardware.devices=3",
                "pipeline.stages=3",
                "pipeline.microbatches=2",
                "train.batch_size=2",
            ],
        ),
    ] {
        let diff = crate::common::max_relative_diff(&one, &run(name, extra));
        assert!(diff < 1e-5, "{name} against one device: {diff:e}");
    }
}

#[test]
fn parquet_rows_read_as_jsonl_lines_do_and_a_bad_row_is_named() {
    let dir = fixtures();
    // pyarrow's Snappy pairs in two row groups, the sixth row without its answer.
    let pairs = kiln_datasets::chat::read_records(&dir.join("pairs.parquet"), None).unwrap();
    assert_eq!(pairs.examples.len(), 7);
    assert_eq!(
        pairs.examples[1].messages,
        [
            Message::new("user", "Name the number after 1."),
            Message::new("assistant", "2")
        ]
    );
    assert_eq!(
        pairs.examples[0].messages[0].content,
        "Name the number after 0.\n\nin words"
    );
    let said = pairs.describe_rejected(3);
    assert!(
        said.contains("pairs.parquet: row 6: field `output` is not a string"),
        "{said}"
    );
    // zstd conversations: the same turns as the JSONL file's first six.
    let chat = kiln_datasets::chat::read_records(
        &dir.join("chat.parquet"),
        Some(&kiln_datasets::chat::Fields::Messages("messages".into())),
    )
    .unwrap();
    let jsonl: Vec<Vec<Message>> = std::fs::read_to_string(dir.join("conversations.jsonl"))
        .unwrap()
        .lines()
        .take(6)
        .map(|l| messages(&serde_json::from_str::<Value>(l).unwrap()["messages"]))
        .collect();
    let got: Vec<Vec<Message>> = chat.examples.into_iter().map(|e| e.messages).collect();
    assert_eq!(got, jsonl);
    // A file that is not Parquet says so.
    let fake = crate::common::temp_dir("chat-parquet");
    let path = fake.join("x.parquet");
    std::fs::write(&path, "{\"instruction\": \"a\"}\n").unwrap();
    let e = kiln_datasets::chat::read_records(&path, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("x.parquet") && e.contains("not a Parquet file"),
        "{e}"
    );
}
