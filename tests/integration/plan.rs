//! The planner: `train plan`'s table and JSON, the plan every run keeps in its summary, the
//! memory limit's refusal, `--strategy auto` under a limit, and programs of one's own (the GAN
//! with two optimizers, the autoencoder).

use std::path::Path;

use kiln::app::App;
use kiln_generative::autoencoder::AutoencoderWorkload;
use kiln_generative::gan::GanWorkload;
use serde_json::Value;

use crate::common::{assert_one_line_error, temp_dir, train_bin, train_bin_kept};
use crate::gpt::text_file;

/// `train` flags of a small GPT on `text` with `extra` flags after them.
fn gpt_flags(text: &Path, run: &Path, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = Vec::new();
    for s in [
        "data.dataset=\"text\"".to_string(),
        format!("data.path={:?}", text.display().to_string()),
        "data.eval_windows=16".into(),
        "model.kind=\"gpt\"".into(),
        "model.gpt.n_layer=2".into(),
        "model.gpt.n_head=2".into(),
        "model.gpt.n_embd=32".into(),
        "model.gpt.block_size=32".into(),
        "train.epochs=0".into(),
        "train.max_steps=6".into(),
        "train.batch_size=32".into(),
        "train.log_every=2".into(),
        "monitor.interval_s=0".into(),
    ] {
        args.push("--set".into());
        args.push(s);
    }
    args.push("--run-dir".into());
    args.push(run.display().to_string());
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn run_train(dir: &Path, args: &[String]) -> std::process::Output {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    train_bin(dir, &args)
}

/// `train plan --json` of the small GPT on `devices` devices.
fn plan_json(dir: &Path, text: &Path, devices: &str, extra: &[&str]) -> Value {
    let mut args = vec!["plan".to_string(), "--json".into()];
    let mut flags = vec!["--devices", devices];
    flags.extend(extra);
    args.extend(gpt_flags(text, &dir.join("never"), &flags));
    let out = run_train(dir, &args);
    assert!(
        out.status.success(),
        "train plan failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !dir.join("never").exists(),
        "train plan wrote a run directory"
    );
    serde_json::from_slice(&out.stdout).expect("train plan --json prints JSON")
}

fn f(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("no number {key} in {v}"))
}

#[test]
fn train_plan_weighs_every_strategy_and_prints_the_fastest_that_fits_first() {
    let dir = temp_dir("plan-table");
    let text = text_file(&dir);
    let plan = plan_json(&dir, &text, "2", &[]);
    let fitting = plan["fitting"].as_array().unwrap();
    let strategies: Vec<&str> = fitting
        .iter()
        .map(|p| p["strategy"].as_str().unwrap())
        .collect();
    for s in [
        "ddp",
        "zero1",
        "zero2",
        "zero3",
        "pipeline 2×2 1f1b",
        "pipeline 2×4 gpipe",
        // The GPT says how it is cut: a tensor-parallel group of the 2 devices.
        "tp 2 × single",
    ] {
        assert!(strategies.contains(&s), "{s} missing from {strategies:?}");
    }
    // Precision, recompute and micro-batch × accumulation are weighed too; the global batch
    // (32 × 2 devices) is kept.
    assert!(fitting.iter().any(|p| p["precision"] == "bf16-mixed"));
    assert!(fitting.iter().any(|p| p["recompute"] == "blocks"));
    assert_eq!(plan["samples_per_step"], 64);
    for p in fitting {
        let (b, a) = (f(p, "batch_size"), f(p, "accumulate"));
        // "pipeline 2×4 1f1b": 2 stages, 4 micro-batches per flush; "tp 2 × single": the
        // strategy inside groups of 2.
        let named = p["strategy"].as_str().unwrap();
        let (tp, named) = match named.strip_prefix("tp ") {
            Some(rest) => {
                let (t, rest) = rest.split_once(" × ").unwrap();
                (t.parse::<f64>().unwrap(), rest)
            }
            None => (1.0, named),
        };
        let words: Vec<&str> = named.split_whitespace().collect();
        let (stages, micro) = match words.get(1) {
            Some(shape) => {
                let (s, m) = shape.split_once('×').unwrap();
                (s.parse::<f64>().unwrap(), m.parse::<f64>().unwrap())
            }
            None => (1.0, 1.0),
        };
        assert_eq!(b * a * micro * 2.0 / (stages * tp), 64.0, "{p}");
        assert!(f(p, "process_bytes") > f(p, "device_bytes"), "{p}");
        assert!(
            f(p, "activation_bytes") > 0.0 && f(p, "step_seconds") > 0.0,
            "{p}"
        );
    }
    // Fastest first.
    let rates: Vec<f64> = fitting.iter().map(|p| f(p, "samples_per_sec")).collect();
    assert!(rates.windows(2).all(|w| w[0] >= w[1]), "{rates:?}");
    // Measured, not assumed: activations grow with the micro-batch, and recompute keeps less.
    let ddp = |batch: f64, recompute: &str| {
        fitting
            .iter()
            .find(|p| {
                p["strategy"] == "ddp"
                    && f(p, "batch_size") == batch
                    && p["recompute"] == recompute
                    && p["precision"] == "32"
            })
            .map(|p| f(p, "activation_bytes"))
            .unwrap()
    };
    assert!(ddp(32.0, "none") > 1.5 * ddp(8.0, "none"));
    assert!(ddp(32.0, "blocks") < ddp(32.0, "none"));
    assert!(plan["measured"]["links"]["all_reduce_s"].as_f64().unwrap() > 0.0);

    // The table: every row a plan, the best plan's flags ready to paste.
    let mut args = vec!["plan".to_string()];
    args.extend(gpt_flags(&text, &dir.join("never"), &["--devices", "2"]));
    let out = run_train(&dir, &args);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}");
    assert!(table.starts_with("plan: 2 devices of cpu"), "{table}");
    let last = table.lines().last().unwrap();
    assert!(last.starts_with("fastest that fits: "), "{table}");
    let rows = table
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()));
    assert!(rows.count() >= 16, "{table}");
    assert!(
        table.contains("more plans (train plan --json lists every one)"),
        "{table}"
    );
    assert!(
        table.contains("--strategy auto (the default) would run: auto → "),
        "{table}"
    );
}

#[test]
fn every_run_keeps_its_plan_beside_what_it_measured() {
    let dir = temp_dir("plan-record");
    let text = text_file(&dir);
    let run = dir.join("run");
    let out = run_train(
        &dir,
        &gpt_flags(&text, &run, &["--devices", "2", "--strategy", "zero2"]),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: Value =
        serde_json::from_slice(&std::fs::read(run.join("summary.json")).unwrap()).unwrap();
    let plan = &summary["plan"];
    let (predicted, measured) = (f(plan, "peak_rss_mib"), f(&summary, "peak_rss_mib"));
    // The bench (`cargo xtask bench plan`) holds the planner to its accuracy on the recipes;
    // here the record is there and of the run's own scale.
    assert!(
        (predicted / measured - 1.0).abs() < 0.35,
        "predicted {predicted} MiB, measured {measured} MiB"
    );
    let (step, took) = (f(plan, "step_seconds"), f(&summary, "step_seconds"));
    assert!(
        step > 0.0 && step < 10.0 * took && took < 10.0 * step,
        "{step} vs {took}"
    );
    assert!(f(plan, "peak_device_mib") < predicted);
}

#[test]
fn a_limit_no_plan_meets_is_refused_at_start_naming_the_smallest_need() {
    let dir = temp_dir("plan-refused");
    let text = text_file(&dir);
    let run = dir.join("run");
    let limit = "hardware.memory_limit_mib=1";
    for strategy in ["ddp", "auto"] {
        let out = run_train(
            &dir,
            &gpt_flags(
                &text,
                &run,
                &["--devices", "2", "--strategy", strategy, "--set", limit],
            ),
        );
        assert_eq!(out.status.code(), Some(2), "{strategy}");
        assert_one_line_error(
            &out,
            &["memory_limit", "no plan fits: the smallest needs", "MiB"],
        );
        assert!(!run.exists(), "a refused run wrote {}", run.display());
    }
    // A limit that is not a size is refused by the config.
    let out = run_train(
        &dir,
        &gpt_flags(&text, &run, &["--set", "hardware.memory_limit_mib=-3"]),
    );
    assert_one_line_error(&out, &["hardware.memory_limit_mib", "-3"]);
}

#[test]
fn a_run_under_a_limit_hands_kept_pages_back_past_the_limit_less_the_headroom() {
    let dir = temp_dir("plan-hold");
    let text = text_file(&dir);
    let summary = |run: &Path| -> Value {
        serde_json::from_slice(&std::fs::read(run.join("summary.json")).unwrap()).unwrap()
    };
    // A limit of 1 MiB that the run is told to ignore: it starts, and its resident memory is
    // past the limit at the end of every step of its one rank.
    let held = dir.join("held");
    let out = run_train(
        &dir,
        &gpt_flags(
            &text,
            &held,
            &[
                "--devices",
                "1",
                "--set",
                "hardware.cpu_split=\"off\"",
                "--set",
                "hardware.memory_limit_mib=1",
                "--set",
                "hardware.memory_limit_force=true",
            ],
        ),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        summary(&held)["memory_holds"],
        6,
        "one hold per step of max_steps = 6"
    );
    // A limit far above the run: nothing handed back, and the count says so.
    let roomy = dir.join("roomy");
    let out = run_train(
        &dir,
        &gpt_flags(
            &text,
            &roomy,
            &[
                "--devices",
                "1",
                "--set",
                "hardware.memory_limit_mib=1000000",
            ],
        ),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(summary(&roomy)["memory_holds"], 0);
    // No limit: no count.
    let free = dir.join("free");
    let out = run_train(&dir, &gpt_flags(&text, &free, &["--devices", "1"]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(summary(&free).get("memory_holds").is_none());
}

/// `train plan --json` of the small GPT on 2 devices, its measurements kept in `cache`.
fn plan_kept(dir: &Path, cache: &Path, text: &Path) -> Value {
    let mut args = vec!["plan".to_string(), "--json".into()];
    args.extend(gpt_flags(text, &dir.join("never"), &["--devices", "2"]));
    let out = train_bin_kept(dir, cache, &args);
    assert!(
        out.status.success(),
        "train plan failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("train plan --json prints JSON")
}

const MIB: f64 = 1024.0 * 1024.0;

/// The plan of `all` with these keys' values.
fn find<'a>(all: &'a [Value], keys: &[(&str, Value)]) -> &'a Value {
    all.iter()
        .find(|p| keys.iter().all(|(k, v)| &p[*k] == v))
        .unwrap_or_else(|| panic!("no plan with {keys:?}"))
}

#[test]
fn auto_under_a_limit_that_ddp_exceeds_runs_a_plan_that_fits() {
    let dir = temp_dir("plan-auto");
    let cache = dir.join("cache");
    let text = text_file(&dir);
    // One probe: the plan measures once and keeps it; the launches below read the same
    // measurements back, so each decision is the one the rule implies from these numbers.
    let plan = plan_kept(&dir, &cache, &text);
    assert_eq!(
        plan["measured"]["kept"]["reused"], false,
        "{}",
        plan["measured"]
    );
    let all: Vec<Value> = plan["fitting"].as_array().unwrap().clone();
    let need = |p: &Value| f(p, "process_bytes") / MIB;
    let ddp = need(find(
        &all,
        &[
            ("strategy", "ddp".into()),
            ("batch_size", 32.into()),
            ("recompute", "none".into()),
            ("precision", "32".into()),
        ],
    ));
    let f32s: Vec<&Value> = all.iter().filter(|p| p["precision"] == "32").collect();
    let smallest = f32s.iter().map(|p| need(p)).fold(f64::MAX, f64::min);
    assert!(
        ddp > smallest + 1.0,
        "ddp {ddp} MiB, smallest {smallest} MiB"
    );
    // Halfway between the two needs, with the 10 % a plan keeps to spare (the rule: a plan
    // fits when its need × 1.1 is within the limit): ddp does not fit, the smallest does.
    let limit = (1.1 * (ddp + smallest) / 2.0 * 10.0).round() / 10.0;
    assert!(ddp * 1.1 > limit && smallest * 1.1 <= limit);
    let run = dir.join("run");
    let set = format!("hardware.memory_limit_mib={limit:.1}");
    // ddp asked by name is refused with its need as the plan measured it, naming a plan that
    // fits.
    let out = train_bin_kept(
        &dir,
        &cache,
        &gpt_flags(
            &text,
            &run,
            &["--devices", "2", "--strategy", "ddp", "--set", &set],
        ),
    );
    assert_one_line_error(
        &out,
        &[
            "memory_limit_mib",
            &format!("this run needs {ddp:.0} MiB per process"),
            "the fastest plan that fits needs",
        ],
    );
    assert!(!run.exists());
    // auto runs one that fits and says why in the start-up table: one of the plans the rule
    // lets fit, with the very prediction `train plan` made of it.
    let out = train_bin_kept(
        &dir,
        &cache,
        &gpt_flags(&text, &run, &["--devices", "2", "--set", &set]),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("auto → "), "{stdout}");
    let summary: Value =
        serde_json::from_slice(&std::fs::read(run.join("summary.json")).unwrap()).unwrap();
    let predicted = f(&summary["plan"], "peak_rss_mib");
    assert!(
        predicted * 1.1 <= limit,
        "the chosen plan predicts {predicted} MiB, limit {limit}"
    );
    assert!(
        f32s.iter().any(|p| need(p) == predicted),
        "auto's plan ({predicted} MiB) is none of train plan's: the measurements differ"
    );
    let config = std::fs::read_to_string(run.join("config.toml")).unwrap();
    assert!(
        summary["strategy"] != "ddp"
            || config.contains("mode = \"blocks\"")
            || config.contains("accumulate = 2")
            || config.contains("accumulate = 4"),
        "{summary}"
    );
}

#[test]
fn the_same_command_near_a_limit_is_decided_the_same_way_every_time() {
    let dir = temp_dir("plan-twice");
    let text = text_file(&dir);
    // A limit at ddp's need as one measurement saw it, 10 % kept to spare: the next
    // measurements land on either side of it.
    let plan = plan_kept(&dir, &dir.join("elsewhere"), &text);
    let all: Vec<Value> = plan["fitting"].as_array().unwrap().clone();
    let need = f(
        find(
            &all,
            &[
                ("strategy", "ddp".into()),
                ("batch_size", 32.into()),
                ("recompute", "none".into()),
                ("precision", "32".into()),
            ],
        ),
        "process_bytes",
    ) / MIB;
    let set = format!("hardware.memory_limit_mib={:.2}", need * 1.1);
    // Three launches of one command with a cache of their own: the first measures, the others
    // read its measurements back and decide as it did, to the byte — unless a run that read
    // them back peaked more than the headroom above their prediction, which drops them
    // (`plan.kept_check`) and has the next launch measure again.
    let cache = dir.join("cache");
    let (mut outcomes, mut dropped) = (Vec::new(), Vec::new());
    for i in 0..3 {
        let run = dir.join(format!("run-{i}"));
        let out = train_bin_kept(
            &dir,
            &cache,
            &gpt_flags(
                &text,
                &run,
                &["--devices", "2", "--strategy", "ddp", "--set", &set],
            ),
        );
        let outcome = if out.status.success() {
            let summary: Value =
                serde_json::from_slice(&std::fs::read(run.join("summary.json")).unwrap()).unwrap();
            let check = summary["plan"]["kept_check"].as_str().map(str::to_string);
            dropped.push(check.clone());
            format!("ran, {} MiB predicted", f(&summary["plan"], "peak_rss_mib"))
        } else {
            assert_one_line_error(&out, &["memory_limit_mib", "this run needs"]);
            dropped.push(None);
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            format!("refused: {}", stderr.trim())
        };
        outcomes.push(outcome);
    }
    println!("{outcomes:#?}\n{dropped:#?}");
    // The first launch measured: nothing of it to check, so the second decides as it did.
    assert_eq!(
        dropped[0], None,
        "a launch that measured checked kept measurements"
    );
    assert_eq!(outcomes[1], outcomes[0], "{outcomes:#?}");
    // The third as the second, unless the second dropped what it read back.
    let remeasured = dropped[1]
        .as_deref()
        .is_some_and(|c| c.contains("dropped: the next launch measures again"));
    if !remeasured {
        assert_eq!(outcomes[2], outcomes[1], "{outcomes:#?}");
    }
    // One entry in the cache: the measurement kept — unless the last launch, which read it
    // back, peaked beyond the headroom and dropped it (then none, and the next measures).
    let entries = std::fs::read_dir(cache.join("plans")).unwrap().count();
    let last_dropped = dropped[2]
        .as_deref()
        .is_some_and(|c| c.contains("dropped: the next launch measures again"));
    assert_eq!(entries, usize::from(!last_dropped), "{dropped:#?}");
    // Without keeping, the planner measures every time and writes nothing.
    let bare = dir.join("bare");
    let out = train_bin_kept(
        &dir,
        &bare,
        &gpt_flags(
            &text,
            &dir.join("run-bare"),
            &[
                "--devices",
                "2",
                "--strategy",
                "ddp",
                "--set",
                "hardware.plan_cache=false",
            ],
        ),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !bare.exists(),
        "hardware.plan_cache = false kept measurements"
    );
}

#[test]
fn train_plan_says_where_its_measurements_come_from() {
    let dir = temp_dir("plan-kept");
    let cache = dir.join("cache");
    let text = text_file(&dir);
    let table = |dir: &Path| {
        let mut args = vec!["plan".to_string()];
        args.extend(gpt_flags(&text, &dir.join("never"), &["--devices", "2"]));
        let out = train_bin_kept(dir, &cache, &args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let first = table(&dir);
    assert!(first.contains("measurements: measured now"), "{first}");
    let second = table(&dir);
    assert!(second.contains("measurements: read back from"), "{second}");
    // The same numbers: every row after the header lines is the same.
    let rows = |t: &str| -> Vec<String> {
        t.lines()
            .filter(|l| {
                l.trim_start()
                    .starts_with(|c: char| c.is_ascii_digit() || c == '*')
            })
            .map(str::to_string)
            .collect()
    };
    assert_eq!(rows(&first), rows(&second));
    // A longer run or another limit reads the same entry; another model does not.
    let mut args = vec!["plan".to_string()];
    args.extend(gpt_flags(
        &text,
        &dir.join("never"),
        &[
            "--devices",
            "2",
            "--max-steps",
            "100",
            "--set",
            "hardware.memory_limit_mib=100000",
        ],
    ));
    let out = train_bin_kept(&dir, &cache, &args);
    assert!(String::from_utf8_lossy(&out.stdout).contains("read back from"));
    args.extend(["--set".to_string(), "model.gpt.n_embd=48".into()]);
    let out = train_bin_kept(&dir, &cache, &args);
    assert!(String::from_utf8_lossy(&out.stdout).contains("measured now"));
}

#[test]
fn kept_measurements_that_predicted_too_low_a_peak_are_dropped_after_the_run() {
    let dir = temp_dir("plan-kept-check");
    let (cache, text) = (dir.join("cache"), text_file(&dir));
    let launch = |i: usize| -> Value {
        let run = dir.join(format!("run-{i}"));
        let out = train_bin_kept(&dir, &cache, &gpt_flags(&text, &run, &["--devices", "2"]));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        serde_json::from_slice(&std::fs::read(run.join("summary.json")).unwrap()).unwrap()
    };
    // Measured now and kept: nothing to check.
    let first = launch(0);
    assert!(first["plan"].get("kept").is_none(), "{}", first["plan"]);
    let entry = std::fs::read_dir(cache.join("plans"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
    let entry = entry.path();
    // The kept bytes as a quieter machine might have measured them: a third of each.
    let mut kept: Value = serde_json::from_slice(&std::fs::read(&entry).unwrap()).unwrap();
    let third = |v: &mut Value| *v = (v.as_f64().unwrap() / 3.0).into();
    for v in kept["floor"].as_array_mut().unwrap() {
        third(v);
    }
    for point in kept["points"].as_object_mut().unwrap().values_mut() {
        for key in ["step_bytes", "held_bytes", "resident_extra"] {
            third(&mut point[key]);
        }
    }
    std::fs::write(&entry, serde_json::to_vec(&kept).unwrap()).unwrap();
    // Read back, the prediction is low; the run says so and drops the entry.
    let second = launch(1);
    let plan = &second["plan"];
    let check = plan["kept_check"]
        .as_str()
        .unwrap_or_else(|| panic!("no check in {plan}"));
    assert!(
        f(&second, "peak_rss_mib") > 1.1 * f(plan, "peak_rss_mib"),
        "{second}"
    );
    assert!(check.contains("dropped"), "{check}");
    assert!(!entry.exists(), "the mispredicting entry is still kept");
    // The next launch measures again, keeps that, and finds nothing to drop.
    let third_run = launch(2);
    assert!(
        third_run["plan"].get("kept_check").is_none(),
        "{}",
        third_run["plan"]
    );
    assert!(entry.exists(), "the fresh measurements were not kept");
}

#[test]
fn a_program_of_ones_own_is_planned_and_records_its_plan() {
    let dir = temp_dir("plan-generative");
    let small = |run: &Path| -> Vec<String> {
        let mut args = vec![
            "x".to_string(),
            "--run-dir".into(),
            run.display().to_string(),
        ];
        for s in [
            "train.epochs=0",
            "train.max_steps=4",
            "train.log_every=2",
            "monitor.interval_s=0",
        ] {
            args.push("--set".into());
            args.push(s.into());
        }
        args
    };
    // The GAN steps two optimizers: the strategies that shard one optimizer are not possible
    // and the plan says so; its run records its plan.
    let gan = App::new("gan", "test").recipe(include_str!("../../configs/gan-digits.toml"));
    let mut args = small(&dir.join("gan"));
    args.extend(["--devices", "2"].map(String::from));
    assert_eq!(gan.run(args.clone(), GanWorkload::new), 0);
    let mut plan_args = args.clone();
    plan_args.insert(1, "plan".into());
    assert_eq!(gan.run(plan_args, GanWorkload::new), 0);
    assert!(!dir.join("gan").join("never").exists());
    let ae = App::new("autoencoder", "test")
        .recipe(include_str!("../../configs/autoencoder-digits.toml"));
    let mut args = small(&dir.join("ae"));
    args.extend(["--devices", "2", "--strategy", "zero1"].map(String::from));
    assert_eq!(ae.run(args, AutoencoderWorkload::new), 0);
    for run in ["gan", "ae"] {
        let summary: Value =
            serde_json::from_slice(&std::fs::read(dir.join(run).join("summary.json")).unwrap())
                .unwrap();
        let plan = &summary["plan"];
        assert!(
            f(plan, "peak_rss_mib") > 0.0 && f(plan, "step_seconds") > 0.0,
            "{run}: {summary}"
        );
    }
}

/// Under a limit a probe key's larger micro-batches are probed only where what the smaller
/// measured predicts that their probe fits (a probe holds what a run at its micro-batch
/// holds): with the limit a little above what ddp's ranks hold between steps, ddp is measured
/// at its smallest micro-batch alone and predicted over the limit from it; without a limit it
/// is measured at its largest too.
#[test]
fn under_a_limit_the_probe_climbs_no_higher_than_it_predicts_to_fit() {
    let dir = temp_dir("plan-rungs");
    let text = text_file(&dir);
    let plan = |cache: &str, limit: f64| -> Value {
        let mut args = vec!["plan".to_string(), "--json".into()];
        let set = format!("hardware.memory_limit_mib={limit:.1}");
        args.extend(gpt_flags(
            &text,
            &dir.join("never"),
            &["--devices", "2", "--set", &set],
        ));
        let out = train_bin_kept(&dir, &dir.join(cache), &args);
        assert!(
            out.status.success(),
            "train plan failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("train plan --json prints JSON")
    };
    let batch = |plan: &Value, end: &str| {
        let fit = &plan["measured"]["fits"]["ddp/32/none"];
        assert!(fit.is_object(), "no ddp probe: {}", plan["measured"]);
        f(&fit[end], "batch")
    };
    let free = plan("free", 100_000.0);
    let (lo, hi) = (batch(&free, "lo"), batch(&free, "hi"));
    assert!(lo < hi && hi == 32.0, "ddp probed at {lo} and {hi}");
    let all = free["fitting"].as_array().unwrap().clone();
    let ddp = find(
        &all,
        &[
            ("strategy", "ddp".into()),
            ("batch_size", 32.into()),
            ("recompute", "none".into()),
            ("precision", "32".into()),
        ],
    );
    let m = &free["measured"];
    let held = f(m, "base_heap")
        + f(m, "base_outside_heap")
        + f(ddp, "ranks")
            * (f(ddp, "params_bytes") + f(ddp, "grads_bytes") + f(ddp, "optim_bytes"));
    // What ddp holds between steps fits with the plan's 10 % to spare and 3 MiB more; its step
    // (activations and the pages the allocator keeps, several MiB a rank) does not.
    let limit = held / MIB * 1.1 + 3.0;
    let tight = plan("tight", limit);
    assert_eq!(batch(&tight, "lo"), lo);
    assert_eq!(
        batch(&tight, "hi"),
        lo,
        "ddp probed above its smallest micro-batch"
    );
    let over = tight["over"].as_array().unwrap();
    for b in [8, 16, 32] {
        let p = find(
            over,
            &[
                ("strategy", "ddp".into()),
                ("batch_size", b.into()),
                ("recompute", "none".into()),
                ("precision", "32".into()),
            ],
        );
        assert_eq!(p["probed"], true, "{p}");
        assert!(f(p, "process_bytes") / MIB * 1.1 > limit, "{p}");
    }
}
