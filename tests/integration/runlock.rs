//! One run directory, one run: a second trainer into a directory a live run holds is refused
//! by name while the first finishes untouched; a holder killed with SIGKILL is taken over.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{assert_one_line_error, temp_dir, tensors, train_bin};

const TRAIN: [&str; 10] = [
    "--max-steps",
    "40",
    "--set",
    "train.checkpoint_every=10",
    "--set",
    "model.convnet.channels=[2, 2]",
    "--set",
    "train.keep_checkpoints=10",
    "--set",
    "train.log_every=10",
];

/// `train FIRST... TRAIN...` in `base`, each step slowed by `slow_ms` (a fault that changes no
/// number).
fn start(base: &Path, first: &[&str], slow_ms: u64) -> Child {
    Command::new(env!("CARGO_BIN_EXE_train"))
        .args(first)
        .args(TRAIN)
        .current_dir(base)
        .env(kiln::trainer::FAULT_VAR, format!("0:1:slow={slow_ms}"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits until `path` exists (at most a minute).
fn wait_for(path: &Path) {
    let until = Instant::now() + Duration::from_secs(60);
    while !path.exists() {
        assert!(Instant::now() < until, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The run's exported weights (names, shapes, bytes), compared without printing them.
fn same_model(a: &Path, b: &Path) -> bool {
    tensors(&a.join("model.safetensors")) == tensors(&b.join("model.safetensors"))
}

#[test]
fn a_second_trainer_into_a_live_run_is_refused_and_a_killed_holder_is_taken_over() {
    let base = temp_dir("runlock");
    let alone = train_bin(&base, &[&["--run-dir", "alone"][..], &TRAIN].concat());
    assert!(alone.status.success(), "{alone:?}");

    // A live run: a resume and a new run into its directory are refused, naming it.
    let mut live = start(&base, &["--run-dir", "live"], 150);
    wait_for(&base.join("live/checkpoints/step-00000010/state.json"));
    let pid = live.id().to_string();
    let holder = format!("process {pid}, since ");
    for second in [&["--resume", "live"][..], &["--run-dir", "live"]] {
        let out = train_bin(&base, &[second, &TRAIN].concat());
        assert_eq!(out.status.code(), Some(kiln::error::exit::REFUSED));
        assert_one_line_error(&out, &["live: a live run holds this directory", &holder]);
    }
    let status = live.wait().unwrap();
    assert!(status.success(), "{:?}", live.stderr.take());
    // The first run went on untouched: every checkpoint it wrote, and bit for bit the model
    // of a run alone.
    let steps: Vec<usize> = kiln::checkpoint::list(&base.join("live"))
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(steps, [10, 20, 30, 40]);
    assert!(same_model(&base.join("live"), &base.join("alone")));
    assert!(!base.join("live").join(kiln::runlock::LOCK_FILE).exists());

    // A launched job holds its directory for every attempt: a trainer or a second launcher
    // into it is refused, naming the launcher, and its own trainers come in.
    let mut job = start(&base, &["launch", "--run-dir", "job", "--"], 150);
    wait_for(&base.join("job/checkpoints/step-00000010/state.json"));
    let launcher = format!("train launch on host {}, process {}", kiln_host(), job.id());
    let out = train_bin(&base, &[&["--resume", "job"][..], &TRAIN].concat());
    assert_one_line_error(&out, &["a live run holds this directory", &launcher]);
    let out = train_bin(
        &base,
        &[&["launch", "--run-dir", "job", "--"][..], &TRAIN].concat(),
    );
    assert_eq!(out.status.code(), Some(kiln::error::exit::REFUSED));
    assert_one_line_error(&out, &["train launch: ", &launcher]);
    assert!(job.wait().unwrap().success(), "{:?}", job.stderr.take());
    assert!(same_model(&base.join("job"), &base.join("alone")));

    // A holder killed mid-run leaves its lock: the resume takes it over, says so, and ends as
    // the run alone.
    let mut killed = start(&base, &["--run-dir", "killed"], 150);
    wait_for(&base.join("killed/checkpoints/step-00000010/state.json"));
    killed.kill().unwrap();
    killed.wait().unwrap();
    assert!(base.join("killed").join(kiln::runlock::LOCK_FILE).exists());
    let out = train_bin(&base, &[&["--resume", "killed"][..], &TRAIN].concat());
    assert!(out.status.success(), "{out:?}");
    let table = String::from_utf8_lossy(&out.stdout);
    let gone = format!("taken over from train on host {}", kiln_host());
    assert!(
        table.contains(&gone) && table.contains(&format!("process {} no longer runs", killed.id())),
        "{table}"
    );
    assert!(same_model(&base.join("killed"), &base.join("alone")));
}

fn kiln_host() -> String {
    kiln::comm::watch::hostname()
}
