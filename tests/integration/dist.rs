//! Runs that never hang and never go unexplained, in one process: a rank that stops making
//! progress ends the run at its deadline naming itself and the collective, every rank's flight
//! record is written and `train flight` names the rank behind, the run resumes from its newest
//! checkpoint; SIGUSR1 writes the flight records of a live run; a straggler is named in
//! `metrics.jsonl` and once on the console.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::{
    finish_within, metrics, records_logged, temp_dir, train_bin, wait_for_records,
};

/// The arguments of a small digits run of `steps` steps on `devices` into `run`.
fn digits_args(run: &Path, devices: usize, steps: usize, sets: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "--config",
        "/dev/null",
        "--run-dir",
        run.to_str().unwrap(),
        "--devices",
        &devices.to_string(),
        "--max-steps",
        &steps.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let base = [
        "data.dataset=\"digits\"",
        "model.convnet.channels=[4, 8]",
        "train.batch_size=16",
        "train.epochs=0",
        "train.log_every=1",
        "train.checkpoint_every=1",
        "monitor.interval_s=0",
    ];
    for s in base.iter().chain(sets) {
        a.push("--set".into());
        a.push(s.to_string());
    }
    a
}

/// Starts `train args` in `cwd` with `env`, its output piped.
fn spawn(cwd: &Path, args: &[String], env: &[(&str, &str)]) -> Child {
    let mut c = Command::new(env!("CARGO_BIN_EXE_train"));
    c.args(args)
        .current_dir(cwd)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().expect("start the train binary")
}

/// The lines of `run`'s flight record of `rank`: the header, then the collectives.
fn flight(run: &Path, rank: usize) -> Vec<Value> {
    let path = run.join("flight").join(format!("rank-{rank}.jsonl"));
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn a_hung_rank_ends_the_run_at_its_deadline_named_with_its_collective_and_the_run_resumes() {
    let dir = temp_dir("hang");
    for devices in [2, 4] {
        let run = dir.join(format!("run-{devices}"));
        let hung = devices - 1;
        let args = digits_args(&run, devices, 1000, &["dist.timeout_s=5"]);
        let fault = format!("{hung}:3:hang");
        let child = spawn(&dir, &args, &[(kiln::trainer::FAULT_VAR, &fault)]);
        // Timed from the first step logged, not from the spawn: the start-up (the planner's
        // probe of 2 or 4 ranks) is not the deadline's, and it stretches on a loaded machine.
        wait_for_records(&run, 1);
        let stepping = Instant::now();
        let (out, _) = finish_within(child, Duration::from_secs(60));
        let took = stepping.elapsed();
        let stderr = String::from_utf8_lossy(&out.stderr);
        println!("devices {devices}: ended {took:?} after its first step: {stderr}");
        // The deadline (5 s), the hung rank's grace to stop (5 s), two steps and slack.
        assert!(took < Duration::from_secs(14), "took {took:?}");
        assert!(!out.status.success());
        assert!(!stderr.contains("panicked"), "{stderr}");
        // One line says it all: who waited, in which collective, who did not arrive.
        let line = stderr
            .lines()
            .find(|l| l.contains("did not arrive"))
            .unwrap_or_else(|| panic!("no line names the absent rank: {stderr}"));
        assert!(line.contains(&format!("rank {hung} (")), "{line}");
        assert!(line.contains("all_reduce #"), "{line}");
        assert!(line.contains("dist.timeout_s = 5"), "{line}");
        // Every rank's flight record, with the hung one out of collectives.
        for rank in 0..devices {
            let record = flight(&run, rank);
            assert_eq!(record[0]["rank"], rank);
            assert_eq!(record[0]["in_flight"].is_null(), rank == hung, "{rank}");
            assert!(record.len() > 1, "rank {rank} recorded no collective");
        }
        let diagnosis = train_bin(&dir, &["flight", run.to_str().unwrap()]);
        let report = String::from_utf8_lossy(&diagnosis.stdout);
        println!("{report}");
        assert!(diagnosis.status.success());
        assert!(report.contains(&format!("behind: rank {hung}")), "{report}");
        // The newest checkpoint (the step before the hang: the hung rank never reached its
        // checkpoint) is whole and the run goes on from it.
        let (newest, _) = kiln::checkpoint::latest(&run).unwrap();
        assert_eq!(newest, 2, "newest checkpoint");
        let resumed = train_bin(
            &dir,
            &["--resume", run.to_str().unwrap(), "--max-steps", "6"],
        );
        assert!(
            resumed.status.success(),
            "{}",
            String::from_utf8_lossy(&resumed.stderr)
        );
        assert_eq!(kiln::checkpoint::latest(&run).unwrap().0, 6);
    }
}

#[test]
fn sigusr1_writes_the_flight_records_of_a_live_run_and_it_goes_on() {
    let dir = temp_dir("sigusr1");
    let run = dir.join("run");
    let child = spawn(&dir, &digits_args(&run, 2, 100_000, &[]), &[]);
    wait_for_records(&run, 3);
    let signal = |name: &str| {
        let sent = Command::new("kill")
            .args([name, &child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
    };
    signal("-USR1");
    let started = Instant::now();
    while !(0..2).all(|r| run.join("flight").join(format!("rank-{r}.jsonl")).exists()) {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no flight records after SIGUSR1"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    wait_for_records(&run, records_logged(&run) + 2);
    signal("-TERM");
    let (out, _) = finish_within(child, Duration::from_secs(30));
    assert_eq!(
        out.status.code(),
        Some(kiln::signal::STOPPED_EXIT_CODE),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for rank in 0..2 {
        let record = flight(&run, rank);
        assert_eq!(record[0]["reason"], "SIGUSR1");
        assert!(record[0]["steps"].as_u64().unwrap() >= 1);
        // Collectives with their kind, group, size, dtype and times.
        let entry = &record[1];
        for key in ["seq", "kind", "group", "elements", "dtype", "start", "end"] {
            assert!(!entry[key].is_null(), "{key} missing in {entry}");
        }
    }
}

#[test]
fn a_straggler_is_named_in_the_metrics_and_once_on_the_console() {
    let dir = temp_dir("straggler");
    let run = dir.join("run");
    let args = digits_args(&run, 2, 16, &["train.checkpoint_every=1000"]);
    let out = spawn(&dir, &args, &[(kiln::trainer::FAULT_VAR, "1:2:slow=150")])
        .wait_with_output()
        .unwrap();
    let console = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{console}");
    let records = metrics(&run, "train");
    let late = &records[records.len() - 1];
    assert_eq!(late["slowest_rank"], 1, "{late}");
    assert!(late["rank_skew"].as_f64().unwrap() > 1.25, "{late}");
    let named: Vec<&str> = console
        .lines()
        .filter(|l| l.contains("straggler: rank 1"))
        .collect();
    assert_eq!(named.len(), 1, "{console}");
}
