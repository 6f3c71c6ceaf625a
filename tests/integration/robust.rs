//! Runs that survive operations: a signal stops a run with a checkpoint it resumes from bit for
//! bit, a non-finite loss stops a run (or is skipped), stale temporary checkpoints go on
//! resume, the best checkpoint is kept, a checkpoint that cannot be written leaves the last one
//! intact, and a CPU run says nothing of NVML.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use burn::prelude::*;
use burn::tensor::FloatDType;
use kiln::builtin::image::ImageWorkload;
use kiln::builtin::train;
use kiln::run::RunOptions;
use kiln::trainer::{TrainerSettings, Workload, fit};
use kiln_models::{Classifier, ImageBatch, ModelSpec};

use crate::common::{metrics, small_config, temp_dir, train_bin, train_losses, wait_for_records};
use crate::gpt::text_file;

/// The arguments of a GPT run of `steps` steps into `run` (with dropout), long enough to be
/// interrupted.
fn gpt_args(text: &Path, run: &Path, steps: usize, devices: usize) -> Vec<String> {
    let mut a = vec![
        "--config".to_string(),
        "/dev/null".into(),
        "--run-dir".into(),
        run.display().to_string(),
        "--devices".into(),
        devices.to_string(),
        "--max-steps".into(),
        steps.to_string(),
    ];
    for s in [
        "data.dataset=\"text\"".to_string(),
        format!("data.path={:?}", text.display().to_string()),
        "data.eval_windows=8".into(),
        "model.kind=\"gpt\"".into(),
        "model.gpt.n_layer=2".into(),
        "model.gpt.n_head=2".into(),
        "model.gpt.n_embd=32".into(),
        "model.gpt.block_size=16".into(),
        // Dropout: the random numbers of every forward resume too.
        "model.gpt.dropout=0.1".into(),
        "train.epochs=0".into(),
        "train.batch_size=8".into(),
        "train.log_every=1".into(),
        "train.checkpoint_every=1000".into(),
        "monitor.interval_s=0".into(),
    ] {
        a.push("--set".into());
        a.push(s);
    }
    a
}

#[test]
fn sigterm_stops_with_a_checkpoint_that_resumes_bit_for_bit_with_dropout() {
    let dir = temp_dir("sigterm");
    let text = text_file(&dir);
    let steps = 400;
    for devices in [1, 2] {
        let full = dir.join(format!("full-{devices}"));
        let out = train_bin(&dir, &to_str(&gpt_args(&text, &full, steps, devices)));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );

        let run = dir.join(format!("stopped-{devices}"));
        let mut child = Command::new(env!("CARGO_BIN_EXE_train"))
            .args(gpt_args(&text, &run, steps, devices))
            .current_dir(&dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Signal once a few steps are logged.
        wait_for_records(&run, 3);
        let signalled = Instant::now();
        let sent = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            assert!(
                signalled.elapsed() < Duration::from_secs(20),
                "the run did not stop after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        println!(
            "devices {devices}: stopped {:?} after SIGTERM",
            signalled.elapsed()
        );
        assert_eq!(
            status.code(),
            Some(kiln::signal::STOPPED_EXIT_CODE),
            "{stdout}"
        );
        assert!(stdout.contains("stopped by SIGTERM"), "{stdout}");
        assert!(stdout.contains("--resume"), "{stdout}");
        let (stopped_at, _) = kiln::checkpoint::latest(&run).unwrap();
        assert!(stopped_at < steps, "stopped at {stopped_at}");

        let resumed = train_bin(&dir, &["--resume", run.to_str().unwrap()]);
        assert!(
            resumed.status.success(),
            "{}",
            String::from_utf8_lossy(&resumed.stderr)
        );
        assert_eq!(train_losses(&run), train_losses(&full), "devices {devices}");
    }
}

fn to_str(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// The image workload, except that rank `rank`'s batch of micro-step `poison` is all NaN.
pub(crate) struct NanAt {
    inner: ImageWorkload,
    rank: usize,
    poison: usize,
    seen: std::sync::atomic::AtomicUsize,
}

impl Workload for NanAt {
    type Model = Classifier;
    type Batch = ImageBatch;

    fn init_model(&self, device: &Device) -> Classifier {
        self.inner.init_model(device)
    }
    fn train_len(&self) -> usize {
        self.inner.train_len()
    }
    fn train_batch(&self, indices: &[usize], device: &Device) -> ImageBatch {
        let batch = self.inner.train_batch(indices, device);
        let on_rank = std::thread::current()
            .name()
            .is_some_and(|n| n.starts_with(&format!("kiln-worker-{}", self.rank)));
        if on_rank && self.seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == self.poison {
            return ImageBatch {
                images: batch.images.mul_scalar(f32::NAN),
                ..batch
            };
        }
        batch
    }
    fn eval_len(&self) -> usize {
        self.inner.eval_len()
    }
    fn eval_batch(&self, range: std::ops::Range<usize>, device: &Device) -> ImageBatch {
        self.inner.eval_batch(range, device)
    }
    fn cast_batch(&self, batch: ImageBatch, dtype: FloatDType) -> ImageBatch {
        self.inner.cast_batch(batch, dtype)
    }
}

/// `n` CPU devices, as [`nan_run`] takes them.
pub(crate) fn cpus(n: usize) -> (Vec<Device>, &'static str) {
    (vec![Device::flex(); n], "cpu")
}

/// Six steps of an MLP on `devices` (of `accelerator`), the last rank's fourth batch all NaN,
/// with `train.skip_nonfinite = skip` and `more` settings (a checkpoint every step unless they
/// say).
pub(crate) fn nan_run(
    dir: &Path,
    skip: usize,
    (devices, accelerator): (Vec<Device>, &str),
    more: &[&str],
) -> (kiln::Result<kiln::metrics::Summary>, NanAt) {
    let skip = format!("train.skip_nonfinite={skip}");
    let mut settings = vec![
        "model.kind=\"mlp\"",
        "model.mlp.hidden=[16]",
        "train.checkpoint_every=1",
        "train.keep_checkpoints=100",
        "train.max_steps=6",
        &skip,
    ];
    settings.extend(more);
    let config = small_config(dir, &settings);
    let splits = kiln_datasets::digits();
    let workload = NanAt {
        inner: ImageWorkload {
            spec: ModelSpec {
                model: config.model.clone(),
                input: Some(kiln::data::input_spec(&splits.train)),
            },
            splits,
        },
        rank: devices.len() - 1,
        poison: 3,
        seen: Default::default(),
    };
    let settings =
        TrainerSettings::from_config(&config.kiln, devices, accelerator.into(), dir.to_path_buf());
    (fit(&workload, &settings).map(|(s, _)| s), workload)
}

#[test]
fn a_nan_loss_stops_the_run_naming_the_step_or_is_skipped_and_counted() {
    let dir = temp_dir("nan");
    let (result, workload) = nan_run(&dir.join("stop"), 0, cpus(2), &[]);
    let message = result.unwrap_err().to_string();
    println!("{message}");
    // Rank 1's fourth batch is step 4's only micro-batch.
    assert!(message.starts_with("training error: step 4:"), "{message}");
    assert!(message.contains("rank 1 micro-batch 0"), "{message}");
    assert!(message.contains("step-00000003"), "{message}");
    assert!(!message.contains('\n'));
    // Nothing was written for step 4, and step 3's checkpoint loads.
    let steps: Vec<usize> = kiln::checkpoint::list(&dir.join("stop"))
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(steps, vec![1, 2, 3]);
    let last = kiln::checkpoint::step_dir(&dir.join("stop"), 3);
    let model = kiln::checkpoint::load_model(&last, workload.init_model(&Device::flex())).unwrap();
    assert!(
        kiln::trainer::parameter_values(&model)
            .iter()
            .flatten()
            .all(|x| x.is_finite())
    );

    let (result, _) = nan_run(&dir.join("skip"), 1, cpus(2), &[]);
    let summary = result.unwrap();
    assert_eq!(summary.steps, 6);
    let records = metrics(&dir.join("skip"), "train");
    assert_eq!(records.last().unwrap()["nonfinite_skipped"], 1);
    assert_eq!(records[2]["nonfinite_skipped"], 0);
    assert!(summary.final_train_loss.is_some());
}

#[test]
fn a_step_refused_on_the_device_is_the_step_refused_on_the_host() {
    // One device (no per-core replicas: a rank alone), a log line and a checkpoint every 3
    // steps: with `host_waits = "log"` the NaN of step 4 is found at step 6.
    let dir = temp_dir("nan-device");
    let every = [
        "hardware.cpu_split=\"off\"",
        "train.log_every=3",
        "train.checkpoint_every=3",
    ];
    let with = |waits: &'static str| {
        let mut s = every.to_vec();
        s.push(waits);
        s
    };
    let each_step = "train.host_waits=\"step\"";
    let at_log = "train.host_waits=\"log\"";
    let (on_host, workload) = nan_run(&dir.join("host"), 1, cpus(1), &with(each_step));
    let (on_device, _) = nan_run(&dir.join("device"), 1, cpus(1), &with(at_log));
    assert_eq!(on_host.unwrap().steps, 6);
    assert_eq!(on_device.unwrap().steps, 6);
    for run in ["host", "device"] {
        let skipped: Vec<_> = metrics(&dir.join(run), "train")
            .iter()
            .map(|r| r["nonfinite_skipped"].as_u64().unwrap())
            .collect();
        assert_eq!(skipped, vec![0, 1], "{run}");
    }
    // The same parameters and optimizer state to the bit: the step left undone, AdamW's count
    // of steps (5) and the corrections of the steps after it as the host's refusal leaves them.
    let last = |run: &str| kiln::checkpoint::step_dir(&dir.join(run), 6);
    let read = |run: &str| {
        let optim = kiln::checkpoint::load_optimizer(&last(run)).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let tensors: Vec<_> = optim.tensors.iter().map(|t| bits(&t.3)).collect();
        let model = kiln::checkpoint::load_model(&last(run), workload.init_model(&Device::flex()));
        let values = kiln::trainer::parameter_values(&model.unwrap()).concat();
        (bits(&values), tensors, optim.scalars)
    };
    let (host_read, device_read) = (read("host"), read("device"));
    assert_eq!(
        host_read.2.get("momentum.time").map(|t| format!("{t:?}")),
        Some(format!(
            "{:?}",
            burn::store::burn_pack::Scalar::from(5usize)
        )),
        "AdamW counted the steps taken"
    );
    assert!(
        host_read == device_read,
        "the parameters or the optimizer state differ"
    );

    // Past `skip_nonfinite` the run stops when it reads, naming the step, and writes nothing
    // after it: step 3's checkpoint is the newest.
    let (stopped, _) = nan_run(&dir.join("stop"), 0, cpus(1), &with(at_log));
    let message = stopped.unwrap_err().to_string();
    assert!(message.starts_with("training error: step 4:"), "{message}");
    assert!(message.contains("at step 6"), "{message}");
    assert!(message.contains("step-00000003"), "{message}");
    let steps: Vec<usize> = kiln::checkpoint::list(&dir.join("stop"))
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(steps, vec![3]);
}

#[test]
fn resume_removes_stale_temporary_checkpoints_and_says_so() {
    let dir = temp_dir("stale");
    let run = dir.join("run");
    let config = small_config(&run, &["train.checkpoint_every=4", "train.max_steps=8"]);
    train(&config, &RunOptions::default()).unwrap();
    let stale = run.join("checkpoints").join(".tmp-step-9-4242");
    std::fs::create_dir_all(&stale).unwrap();
    std::fs::write(stale.join("model.bpk"), b"half a file").unwrap();
    let out = train_bin(
        &dir,
        &["--resume", run.to_str().unwrap(), "--max-steps", "10"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("removed 1 temporary checkpoint directory") && stdout.contains("4242"),
        "{stdout}"
    );
    assert!(!stale.exists());
}

#[test]
fn the_best_checkpoint_is_kept_beside_the_newest() {
    // The mechanism, with scores chosen so that the best is not the newest.
    let dir = temp_dir("best");
    let config = small_config(
        &dir.join("unit"),
        &["model.kind=\"mlp\"", "train.max_steps=1"],
    );
    let result = train(&config, &RunOptions::default()).unwrap();
    let (_, ckpt) = kiln::checkpoint::latest(&result.dir).unwrap();
    let state = kiln::checkpoint::read_state(&ckpt).unwrap();
    let optim = kiln::checkpoint::load_optimizer(&ckpt).unwrap();
    let model = kiln_models::load_run(&result.dir, &Device::flex()).unwrap();
    let run = dir.join("scores");
    for (step, loss) in [(1, 0.5), (2, 0.2), (3, 0.4), (4, 0.3)] {
        let state = kiln::checkpoint::LoopState {
            step,
            ..state.clone()
        };
        let score = kiln::checkpoint::Score {
            metric: "val_loss",
            value: loss,
        };
        kiln::checkpoint::save(
            &run,
            &model,
            &[(String::new(), optim.clone())],
            &state,
            1,
            Some(score),
        )
        .unwrap();
    }
    let kept: Vec<usize> = kiln::checkpoint::list(&run)
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(kept, vec![2, 4]);
    assert_eq!(kiln::checkpoint::read_best(&run).unwrap().step, 2);

    // End to end: validation at every checkpoint, the best by accuracy kept.
    let run = dir.join("run");
    let config = small_config(
        &run,
        &[
            "train.checkpoint_every=3",
            "train.keep_checkpoints=1",
            "train.max_steps=12",
            "train.best_metric=\"val_accuracy\"",
        ],
    );
    train(&config, &RunOptions::default()).unwrap();
    let best = kiln::checkpoint::read_best(&run).unwrap();
    let vals = metrics(&run, "val");
    let top = vals
        .iter()
        .map(|r| r["accuracy"].as_f64().unwrap())
        .fold(0.0, f64::max);
    assert_eq!(best.value, top);
    let kept: Vec<usize> = kiln::checkpoint::list(&run)
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert!(
        kept.contains(&best.step) && kept.contains(&12),
        "{kept:?} {best:?}"
    );
    assert!(kept.len() <= 2);
    let bad = kiln::builtin::load(None, &["train.best_metric=\"loss\"".to_string()]);
    assert!(bad.unwrap_err().to_string().contains("train.best_metric"));
}

#[test]
fn a_checkpoint_that_cannot_be_written_is_one_error_and_the_last_one_stays() {
    let dir = temp_dir("no-space");
    let run = dir.join("run");
    // The default ConvNet: a 60 KB model file, a 120 KB optimizer file.
    let config = small_config(
        &run,
        &[
            "train.max_steps=2",
            "monitor.sinks=[\"jsonl\"]",
            "model.convnet.channels=[16, 32]",
        ],
    );
    train(&config, &RunOptions::default()).unwrap();
    // A file-size limit of 16 KiB: the run's small files fit, a checkpoint's model does not.
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -f 32 && exec {} --resume {} --max-steps 4",
            env!("CARGO_BIN_EXE_train"),
            run.display()
        ))
        .current_dir(&dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stderr}");
    assert!(!out.status.success());
    assert!(!stderr.contains("panicked"), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: checkpoint error:") && last.contains(".bpk"),
        "{last}"
    );
    // No half-written directory, and the step-2 checkpoint still loads.
    let leftovers: Vec<_> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty());
    let (step, ckpt) = kiln::checkpoint::latest(&run).unwrap();
    assert_eq!(step, 2);
    kiln::checkpoint::load_optimizer(&ckpt).unwrap();
    kiln_models::load_run(&run, &Device::flex()).unwrap();
    // Sharded on 2 devices: a rank's file past the limit is the one error, named.
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -f 32 && exec {} --resume {} --max-steps 4 --devices 2 --set \
             train.batch_size=8 --set 'train.checkpoint_format=\"sharded\"'",
            env!("CARGO_BIN_EXE_train"),
            run.display()
        ))
        .current_dir(&dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(!stderr.contains("panicked"), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: checkpoint error:") && last.contains(".bin"),
        "{last}"
    );
    assert_eq!(kiln::checkpoint::latest(&run).unwrap().0, 2);
}

#[test]
fn a_cpu_run_says_nothing_of_nvml_unless_asked() {
    let dir = temp_dir("nvml");
    let quiet = train_bin(&dir, &["--max-steps", "2", "--run-dir", "quiet"]);
    assert!(quiet.status.success());
    let text = String::from_utf8_lossy(&quiet.stdout).to_string()
        + &String::from_utf8_lossy(&quiet.stderr);
    assert!(!text.contains("NVML"), "{text}");
    let asked = train_bin(
        &dir,
        &[
            "--max-steps",
            "2",
            "--run-dir",
            "asked",
            "--set",
            "monitor.gpu=true",
        ],
    );
    assert!(asked.status.success());
    assert!(String::from_utf8_lossy(&asked.stdout).contains("NVML unavailable"));
}

#[test]
fn a_resume_the_checkpoint_cannot_take_names_the_key_and_changes_nothing() {
    let dir = temp_dir("resume-check");
    let run = dir.join("run");
    let run_s = run.to_str().unwrap();
    let first_args = vec![
        "--config",
        "/dev/null",
        "--run-dir",
        run_s,
        "--max-steps",
        "4",
        "--set",
        "data.dataset=\"digits\"",
        "--set",
        "model.convnet.channels=[4, 8]",
        "--set",
        "train.epochs=0",
        "--set",
        "train.checkpoint_every=2",
        "--set",
        "train.log_every=1",
        "--set",
        "monitor.interval_s=0",
    ];
    let first = train_bin(&dir, &first_args);
    assert!(first.status.success());
    let before = files(&run);
    let refused = train_bin(
        &dir,
        &[
            "--resume",
            run_s,
            "--max-steps",
            "6",
            "--set",
            "model.convnet.channels=[4, 16]",
        ],
    );
    crate::common::assert_one_line_error(
        &refused,
        &["cannot resume", "model.convnet.channels [4, 8] → [4, 16]"],
    );
    assert!(
        files(&run) == before,
        "a refused resume changed the run directory"
    );
    // Another number of samples per step would not continue the data order: refused before
    // anything is written, too.
    let refused = train_bin(&dir, &["--resume", run_s, "--batch-size", "7"]);
    crate::common::assert_one_line_error(&refused, &["samples per step"]);
    assert!(
        files(&run) == before,
        "a refused resume changed the run directory"
    );
    // The run then goes on as it was, bit for bit with a run never interrupted.
    let plain = train_bin(&dir, &["--resume", run_s, "--max-steps", "6"]);
    assert!(plain.status.success());
    let whole = dir.join("whole");
    let mut args = first_args.clone();
    args[3] = whole.to_str().unwrap();
    args[5] = "6";
    assert!(train_bin(&dir, &args).status.success());
    assert_eq!(train_losses(&run), train_losses(&whole));
    // A change it can take is said.
    let resumed = train_bin(
        &dir,
        &[
            "--resume",
            run_s,
            "--max-steps",
            "8",
            "--set",
            "optim.lr=0.002",
        ],
    );
    let stdout = String::from_utf8_lossy(&resumed.stdout);
    assert!(resumed.status.success(), "{stdout}");
    assert!(
        stdout.contains("from step 6 (")
            && stdout.contains("changed from the run's config: optim.lr 0.001 → 0.002"),
        "{stdout}"
    );
    assert_eq!(kiln::checkpoint::latest(&run).unwrap().0, 8);
}

/// Every file under `dir` with its bytes.
fn files(dir: &Path) -> std::collections::BTreeMap<std::path::PathBuf, Vec<u8>> {
    let mut all = std::collections::BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                todo.push(path);
            } else {
                all.insert(path.clone(), std::fs::read(&path).unwrap());
            }
        }
    }
    all
}
