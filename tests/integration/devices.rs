//! Devices, honestly, in every build: CUDA where a driver and a device answer and nowhere
//! else, a software WGPU adapter never chosen by `auto`, and one line where something is
//! missing. CI runs this module against the `cuda` build too (`--features cuda`), on a machine
//! without a GPU: such a build must behave as the default one does.

use crate::common::{assert_one_line_error, temp_dir, train_bin};

/// What the driver answers on this machine, and whether this build can use it.
fn cuda_runs_here() -> bool {
    cfg!(feature = "cuda") && kiln::run::cuda_cards().is_ok()
}

#[test]
fn accelerator_cuda_where_cuda_cannot_run_is_one_line_and_writes_nothing() {
    let dir = temp_dir("accel-cuda");
    let out = train_bin(&dir, &["--accelerator", "cuda", "--max-steps", "1"]);
    if cuda_runs_here() {
        // A driver and a device answer: the run trains on them.
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    let why = if cfg!(feature = "cuda") {
        kiln::run::cuda_cards().unwrap_err()
    } else {
        "the `cuda` feature".to_string()
    };
    assert_one_line_error(&out, &["hardware.accelerator = \"cuda\"", &why]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        !dir.join("runs").exists(),
        "a refused run wrote its directory"
    );
}

#[test]
fn auto_trains_where_train_devices_says_and_the_table_says_why() {
    let dir = temp_dir("accel-auto");
    let out = train_bin(&dir, &["devices"]);
    assert!(out.status.success());
    let report = String::from_utf8(out.stdout).unwrap();
    let auto = report
        .lines()
        .find_map(|l| l.strip_prefix("auto   --accelerator auto chooses "))
        .expect("the auto line");
    let (chosen, why) = auto.split_once(": ").expect("auto says why");
    // The same decision, by the library: never CUDA that does not answer, never software.
    let (kind, reason) = kiln::run::auto_choice();
    assert_eq!(chosen, kiln::config::name_of(&kind), "{report}");
    assert_eq!(why, reason);
    if !cuda_runs_here() {
        assert_ne!(chosen, "cuda", "{report}");
    }
    if chosen == "wgpu" {
        assert!(
            kiln::run::wgpu_adapters().iter().any(|a| a.hardware),
            "{report}"
        );
    }
    // A run with no accelerator named trains there, and its start-up table says why.
    let out = train_bin(&dir, &["--max-steps", "2", "--run-dir", "run"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(&format!("(auto: {reason})")), "{stdout}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("run/summary.json")).unwrap())
            .unwrap();
    let accelerator = summary["accelerator"].as_str().unwrap();
    assert!(accelerator.starts_with(chosen), "{accelerator} vs {chosen}");
}

#[test]
fn train_devices_lists_what_is_there() {
    let dir = temp_dir("devices-list");
    let out = train_bin(&dir, &["devices"]);
    let report = String::from_utf8(out.stdout).unwrap();
    let adapters = kiln::run::wgpu_adapters();
    for (i, a) in adapters.iter().enumerate() {
        let kind = if a.hardware { "hardware" } else { "software" };
        let line = format!("wgpu   [{i}] {}, {kind}", a.name);
        assert!(
            report.lines().any(|l| l.starts_with(&line)),
            "{line}: {report}"
        );
    }
    let cuda: Vec<&str> = report.lines().filter(|l| l.starts_with("cuda ")).collect();
    match kiln::run::cuda_cards() {
        Ok(cards) => assert_eq!(cuda.len(), cards.len(), "{report}"),
        Err(why) => {
            assert_eq!(cuda.len(), 1, "{report}");
            assert!(cuda[0].contains(&why), "{report}");
            assert!(cuda[0].starts_with("cuda   none: "), "{report}");
            if !cfg!(feature = "cuda") {
                assert!(cuda[0].contains("lacks the `cuda` feature"), "{report}");
            }
        }
    }
    assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
}
