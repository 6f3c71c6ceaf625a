//! Runs that heal: checkpoints that prove themselves (a damaged one is named and passed over,
//! never trained from), and exit codes a launcher can act on.

use std::path::Path;
use std::process::Output;

use crate::common::{
    assert_one_line_error, restarts, summary, temp_dir, tensors, train_bin, train_losses,
};

/// A small digits run's flags: the ConvNet at its smallest, `steps` steps.
fn run_args<'a>(dir: &'a str, steps: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "--run-dir",
        dir,
        "--max-steps",
        steps,
        "--set",
        "model.convnet.channels=[2, 2]",
        "--set",
        "train.checkpoint_every=2",
        "--set",
        "train.keep_checkpoints=3",
    ];
    a.extend_from_slice(extra);
    a
}

fn ok(out: &Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// The two kinds of damage a disk or a copy does: one byte flipped in the middle, or the file
/// cut short.
fn damage(file: &Path, truncate: bool) {
    let mut bytes = std::fs::read(file).unwrap();
    if truncate {
        bytes.truncate(bytes.len() / 2);
    } else {
        let at = bytes.len() / 2;
        bytes[at] ^= 0x40;
    }
    std::fs::write(file, bytes).unwrap();
}

#[test]
fn a_damaged_newest_checkpoint_is_passed_over_and_the_run_ends_as_if_resumed_before_it() {
    let base = temp_dir("heal-damaged");
    ok(&train_bin(&base, &run_args("full", "6", &[])));
    let steps: Vec<usize> = kiln::checkpoint::list(&base.join("full"))
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(steps, [2, 4, 6]);
    // The reference: resumed from step 4 directly, to step 8.
    copy_dir(&base.join("full"), &base.join("direct"));
    let from_four = "direct/checkpoints/step-00000004";
    ok(&train_bin(
        &base,
        &["--resume", from_four, "--max-steps", "8"],
    ));
    let reference = train_losses(&base.join("direct"));
    let reference_model = tensors(&base.join("direct/model.safetensors"));
    for file in [kiln::checkpoint::MODEL_FILE, kiln::checkpoint::OPTIM_FILE] {
        for truncate in [false, true] {
            let case = format!("{}-{}", file, if truncate { "cut" } else { "flip" });
            copy_dir(&base.join("full"), &base.join(&case));
            damage(
                &base
                    .join(&case)
                    .join("checkpoints/step-00000006")
                    .join(file),
                truncate,
            );
            let out = train_bin(&base, &["--resume", &case, "--max-steps", "8"]);
            ok(&out);
            let stderr = String::from_utf8_lossy(&out.stderr);
            for needle in [
                "skipping damaged checkpoint step 6",
                file,
                "corrupt",
                "step 4",
            ] {
                assert!(
                    stderr.contains(needle),
                    "{case}: {needle:?} not in {stderr}"
                );
            }
            let expected = if truncate { "(truncated)" } else { "SHA-256" };
            assert!(stderr.contains(expected), "{case}: {stderr}");
            // The same steps after the resume, to the bit, and the same final weights.
            assert_eq!(train_losses(&base.join(&case)), reference, "{case}");
            let model = tensors(&base.join(&case).join("model.safetensors"));
            assert!(model == reference_model, "{case}: the final weights differ");
        }
    }
}

#[test]
fn with_no_whole_checkpoint_and_a_changed_setting_the_error_names_the_file() {
    let base = temp_dir("heal-none");
    ok(&train_bin(
        &base,
        &run_args("run", "4", &["--set", "train.keep_checkpoints=1"]),
    ));
    let newest = kiln::checkpoint::latest(&base.join("run")).unwrap().1;
    damage(&newest.join(kiln::checkpoint::MODEL_FILE), true);
    let out = train_bin(&base, &["--resume", "run", "--max-steps", "60"]);
    assert_one_line_error(
        &out,
        &[
            "model.bpk",
            "corrupt",
            "truncated",
            "no checkpoint is whole",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("max_steps"),
        "the error blames a setting: {stderr}"
    );
    assert_eq!(out.status.code(), Some(kiln::error::exit::REFUSED));
    // `train checkpoints` says the same of it.
    let out = train_bin(&base, &["checkpoints", "run"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(kiln::error::exit::REFUSED),
        "{stdout}"
    );
    assert!(
        stdout.contains("DAMAGED") && stdout.contains("model.bpk"),
        "{stdout}"
    );
}

#[test]
fn train_checkpoints_lists_each_with_its_state() {
    let base = temp_dir("heal-list");
    ok(&train_bin(&base, &run_args("run", "6", &[])));
    let out = train_bin(&base, &["checkpoints", "run"]);
    ok(&out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    // `--run DIR`, as `sample` and `eval` take a run, says the same; neither, or both, is
    // refused by the command line, naming RUN_DIR.
    let by_flag = train_bin(&base, &["checkpoints", "--run", "run"]);
    ok(&by_flag);
    assert_eq!(String::from_utf8_lossy(&by_flag.stdout), stdout);
    for args in [
        &["checkpoints"][..],
        &["checkpoints", "run", "--run", "run"],
    ] {
        let out = train_bin(&base, args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.starts_with("error: ") && stderr.contains("RUN_DIR"),
            "{args:?}: {stderr}"
        );
    }
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 4, "{stdout}");
    assert!(lines[..3].iter().all(|l| l.contains("whole")), "{stdout}");
    assert!(lines[3].contains("starts from step 6"), "{stdout}");
    damage(
        &base.join("run/checkpoints/step-00000006/optimizer.bpk"),
        false,
    );
    let out = train_bin(&base, &["checkpoints", "run"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("DAMAGED") && stdout.contains("starts from step 4"),
        "{stdout}"
    );
}

#[test]
fn exit_codes_tell_a_refusal_from_a_failure_and_a_divergence() {
    let base = temp_dir("heal-codes");
    use kiln::error::exit;
    // A refusal: the config.
    let out = train_bin(&base, &["--set", "train.batch_size=0"]);
    assert_eq!(out.status.code(), Some(exit::REFUSED));
    // A failure while running: a rank panics after step 2.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
        .args(run_args("failed", "6", &["--devices", "2"]))
        .env(kiln::trainer::FAULT_VAR, "1:2")
        .current_dir(&base)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(exit::FAILED), "{stderr}");
    assert!(stderr.contains("rank 1"), "{stderr}");
    // A divergence: the rate sends the weights to infinity, the next loss is not finite.
    let out = train_bin(
        &base,
        &run_args(
            "diverged",
            "6",
            &["--set", "optim.name=\"sgd\"", "--lr", "1e30"],
        ),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(exit::DIVERGED), "{stderr}");
    assert!(stderr.contains("non-finite"), "{stderr}");
}

/// `train launch` in this directory, with `env` set, returning the launcher's output.
fn launch(base: &Path, launch_args: &[&str], train: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_train"));
    c.arg("launch")
        .args(launch_args)
        .arg("--")
        .args(train)
        .current_dir(base);
    c.env_remove("RUST_BACKTRACE");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

const TRAIN: [&str; 6] = [
    "--max-steps",
    "8",
    "--set",
    "train.checkpoint_every=2",
    "--set",
    "model.convnet.channels=[2, 2]",
];

#[test]
fn the_launcher_restarts_a_failed_run_which_ends_as_the_uninterrupted_one() {
    let base = temp_dir("launch-restart");
    ok(&train_bin(
        &base,
        &[&["--run-dir", "plain"][..], &TRAIN].concat(),
    ));
    let out = launch(
        &base,
        &[
            "--run-dir",
            "healed",
            "--restarts",
            "2",
            "--backoff-s",
            "0.1",
        ],
        &TRAIN,
        &[(kiln::trainer::FAULT_VAR, "0:5")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("restart 1 of 2 after exit 4"), "{stderr}");
    assert!(stderr.contains("injected failure after step 5"), "{stderr}");
    let lines = restarts(&base.join("healed"));
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["exit"], 4);
    assert_eq!(lines[0]["resumed_from_step"], 4);
    assert!(lines[0]["failure"].as_str().unwrap().contains("rank 0"));
    let summary = summary(&base.join("healed"));
    assert_eq!(summary["restarts"], 1);
    assert_eq!(summary["steps"], 8);
    // The same run: the restart resumed bit for bit.
    assert!(
        tensors(&base.join("healed/model.safetensors"))
            == tensors(&base.join("plain/model.safetensors"))
    );
    // The failure's flight records are kept where `train flight` reads them.
    let flight = train_bin(&base, &["flight", "healed/restarts/attempt-1"]);
    ok(&flight);
}

/// A failure before the first checkpoint: the launcher starts the run over in the same
/// directory (the failed attempt's files kept under `restarts/attempt-1/run/`), and the run
/// ends as the uninterrupted one, bit for bit.
#[test]
fn a_failure_before_the_first_checkpoint_starts_the_run_over() {
    let base = temp_dir("launch-over");
    let train = [&TRAIN[..], &["--set", "train.checkpoint_every=30"]].concat();
    ok(&train_bin(
        &base,
        &[&["--run-dir", "plain"][..], &train].concat(),
    ));
    let out = launch(
        &base,
        &["--run-dir", "over", "--restarts", "2", "--backoff-s", "0.1"],
        &train,
        &[(kiln::trainer::FAULT_VAR, "0:5")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("restart 1 of 2 after exit 4") && stderr.contains("from the start"),
        "{stderr}"
    );
    let lines = restarts(&base.join("over"));
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["started_over"], true);
    assert!(lines[0]["resumed_from_step"].is_null());
    let kept = base.join("over/restarts/attempt-1/run");
    assert!(kept.join("config.toml").is_file(), "{}", kept.display());
    let summary = summary(&base.join("over"));
    assert_eq!(
        (summary["restarts"].clone(), summary["steps"].clone()),
        (1.into(), 8.into())
    );
    assert!(
        tensors(&base.join("over/model.safetensors"))
            == tensors(&base.join("plain/model.safetensors"))
    );
}

#[test]
fn the_launcher_passes_a_refusal_and_a_stop_through_and_gives_up_after_its_restarts() {
    let base = temp_dir("launch-final");
    use kiln::error::exit;
    // A refusal is never retried.
    let out = launch(
        &base,
        &["--run-dir", "refused"],
        &["--set", "train.batch_size=0"],
        &[],
    );
    assert_eq!(out.status.code(), Some(exit::REFUSED));
    assert!(
        !base
            .join("refused")
            .join(kiln::launcher::RESTARTS_FILE)
            .exists()
    );
    // A failure at every attempt: the restarts run out, each failure is listed.
    let out = launch(
        &base,
        &[
            "--run-dir",
            "failing",
            "--restarts",
            "2",
            "--backoff-s",
            "0.05",
        ],
        &TRAIN,
        &[
            (kiln::trainer::FAULT_VAR, "0:3"),
            (kiln::trainer::FAULT_ATTEMPTS_VAR, "99"),
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(exit::FAILED), "{stderr}");
    let gave_up = stderr
        .lines()
        .find(|l| l.contains("gave up after 2 restart(s)"));
    let gave_up = gave_up.unwrap_or_else(|| panic!("{stderr}"));
    for attempt in 1..=3 {
        assert!(
            gave_up.contains(&format!("attempt {attempt} exited 4")),
            "{gave_up}"
        );
    }
    // SIGTERM to the launcher: the run stops with its checkpoint, no restart.
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
        .args([
            "launch",
            "--run-dir",
            "stopped",
            "--",
            "--max-steps",
            "100000",
        ])
        .args(["--set", "train.epochs=0", "--set", "train.log_every=1"])
        .args(["--set", "model.convnet.channels=[2, 2]"])
        .current_dir(&base)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    crate::common::wait_for_records(&base.join("stopped"), 3);
    // SAFETY: kill(2) on the launcher we started.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let (out, _) = crate::common::finish_within(child, std::time::Duration::from_secs(30));
    assert_eq!(
        out.status.code(),
        Some(exit::STOPPED),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(kiln::checkpoint::latest(&base.join("stopped")).is_ok());
    assert!(
        !base
            .join("stopped")
            .join(kiln::launcher::RESTARTS_FILE)
            .exists()
    );
}

/// A checkpoint written in the background holds its own step's buffers: BatchNorm's running
/// statistics are shared with the training model and updated in place by the next steps, so
/// the writer takes the model's record before the steps go on. With the writer made slow
/// (the steps after it run while it waits), step 10's checkpoint holds exactly what a
/// foreground write holds.
#[test]
fn a_slow_background_write_holds_its_own_steps_batchnorm_statistics() {
    let base = temp_dir("async-buffers");
    let train = [
        "--max-steps",
        "20",
        "--set",
        "train.checkpoint_every=10",
        "--set",
        "model.convnet.channels=[2, 2]",
    ];
    let sync = [
        &["--run-dir", "sync"][..],
        &train,
        &["--set", "train.checkpoint_async=false"],
    ]
    .concat();
    ok(&train_bin(&base, &sync));
    let slow = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
        .args(["--run-dir", "slow"])
        .args(train)
        .current_dir(&base)
        .env(kiln::trainer::FAULT_VAR, "0:10:slow-write=1500")
        .output()
        .unwrap();
    ok(&slow);
    // Step 10's checkpoint loaded into the run's model: its parameters and buffers.
    let at_10 = |run: &str| {
        let dir = base.join(run);
        let model = kiln_models::load_run(&dir, &burn::tensor::Device::flex()).unwrap();
        let model = kiln::checkpoint::load_model(&kiln::checkpoint::step_dir(&dir, 10), model);
        kiln::trainer::parameter_values(&model.unwrap())
    };
    let (slow, sync) = (at_10("slow"), at_10("sync"));
    let differ: Vec<usize> = (0..slow.len()).filter(|&i| slow[i] != sync[i]).collect();
    assert!(
        differ.is_empty(),
        "step 10's tensors {differ:?} (of {}) differ when written in the background",
        slow.len()
    );
}

/// Checkpoints off the step's path: while step 20's checkpoint is being written (a writer
/// made slow), the steps go on; a SIGKILL then leaves step 10's the newest whole one, and the
/// resume from it ends bit for bit as the run alone.
#[test]
fn a_kill_during_a_background_write_resumes_from_the_checkpoint_before_it() {
    let base = temp_dir("async-kill");
    let train = [
        "--max-steps",
        "40",
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
    let alone = summary(&base.join("alone"));
    // Four checkpoints, each with its time on the step's path.
    assert_eq!(alone["checkpoint_stall_s"].as_array().unwrap().len(), 4);
    let mut run = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
        .args(["--run-dir", "killed"])
        .args(train)
        .current_dir(&base)
        .env(kiln::trainer::FAULT_VAR, "0:20:slow-write=30000")
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
    // The run is five steps past a checkpoint that is not on disk yet.
    let whole: Vec<usize> = kiln::checkpoint::list(&dir).iter().map(|c| c.0).collect();
    assert_eq!(whole, [10]);
    run.kill().unwrap();
    run.wait().unwrap();
    let out = train_bin(&base, &[&["--resume", "killed"][..], &train].concat());
    ok(&out);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("from step 10"), "{said}");
    assert!(
        tensors(&base.join("killed/model.safetensors"))
            == tensors(&base.join("alone/model.safetensors"))
    );
}
