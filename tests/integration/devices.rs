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

/// `--accelerator cube-cpu` in a build without CubeCL's CPU runtime: one line naming the
/// feature, nothing written. (With the feature, `cube_cpu::` trains on it.)
#[cfg(not(feature = "cube-cpu"))]
#[test]
fn accelerator_cube_cpu_without_its_feature_is_one_line_and_writes_nothing() {
    let dir = temp_dir("accel-cube-cpu");
    let out = train_bin(&dir, &["--accelerator", "cube-cpu", "--max-steps", "1"]);
    assert_one_line_error(
        &out,
        &[
            "hardware.accelerator = \"cube-cpu\"",
            "the `cube-cpu` feature",
        ],
    );
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
    // CubeCL's CPU runtime: one line, saying whether this build has it.
    let cube: Vec<&str> = report
        .lines()
        .filter(|l| l.starts_with("cube-cpu "))
        .collect();
    assert_eq!(cube.len(), 1, "{report}");
    assert_eq!(
        cube[0].contains("lacks the `cube-cpu` feature"),
        !cfg!(feature = "cube-cpu"),
        "{report}"
    );
    assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
}

/// Builds `libcuda.so` from the C `source` in `dir` (with `cc`, the C compiler that links Rust
/// programs) and returns a runner of `train` in `dir` that finds it first on the library path.
#[cfg(unix)]
fn with_fake_driver(
    dir: &std::path::Path,
    source: &str,
) -> impl Fn(&[&str]) -> std::process::Output {
    let c = dir.join("libcuda.c");
    std::fs::write(&c, source).unwrap();
    let built = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(dir.join("libcuda.so"))
        .arg(&c)
        .output()
        .expect("cc (the C compiler that links Rust programs) runs");
    assert!(built.status.success(), "{built:?}");
    let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let dir = dir.to_path_buf();
    move |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_train"))
            .args(args)
            .current_dir(&dir)
            .env("LD_LIBRARY_PATH", format!("{}:{path}", dir.display()))
            .output()
            .unwrap()
    }
}

/// A driver library whose `cuInit` answers as the CUDA toolkit's stub does (error 34), found
/// first on the library path, as a `stubs` folder on `LD_LIBRARY_PATH` makes it on a GPU
/// machine. Burn's CUDA runtime loads `libcuda.so` before `libcuda.so.1`, so kiln asks the
/// same library, and `train devices` and a CUDA run say what is wrong in one line (before,
/// the driver answered through `libcuda.so.1` and Burn's runtime panicked on the stub).
#[cfg(unix)]
#[test]
fn a_stub_cuda_library_first_on_the_path_is_named_in_one_line() {
    let dir = temp_dir("cuda-stub");
    let train = with_fake_driver(
        &dir,
        "int cuInit(unsigned f) { return 34; }\n\
         int cuDeviceGetCount(int *n) { *n = 0; return 34; }\n\
         int cuDeviceGet(int *d, int i) { return 34; }\n\
         int cuDeviceGetName(char *s, int n, int d) { return 34; }\n\
         int cuDeviceTotalMem_v2(unsigned long *b, int d) { return 34; }\n",
    );
    let why = format!(
        "{} is the CUDA toolkit's stub library (CUDA_ERROR_STUB_LIBRARY)",
        dir.join("libcuda.so").display()
    );
    let out = train(&["devices"]);
    assert!(out.status.success());
    let report = String::from_utf8(out.stdout).unwrap();
    let cuda = report.lines().find(|l| l.starts_with("cuda ")).unwrap();
    assert!(cuda.contains(&why), "{report}");
    assert!(
        report.contains("--accelerator auto chooses cpu"),
        "{report}"
    );
    let out = train(&["--accelerator", "cuda", "--max-steps", "1"]);
    let needle = if cfg!(feature = "cuda") {
        why.as_str()
    } else {
        "the `cuda` feature"
    };
    assert_one_line_error(&out, &["hardware.accelerator = \"cuda\"", needle]);
    assert!(
        !dir.join("runs").exists(),
        "a refused run wrote its directory"
    );
}

/// A driver library that answers kiln's questions (one device, "Fake GPU") and lacks every
/// other function of the driver API: in the `cuda` build, Burn's runtime panics on it in a
/// thread of its own when the run first asks the device something, and the run refuses in one
/// line that names the device and the runtime's own message; nothing is written.
#[cfg(unix)]
#[test]
fn a_cuda_runtime_that_panics_at_start_is_a_one_line_refusal() {
    let dir = temp_dir("cuda-fake");
    let train = with_fake_driver(
        &dir,
        "#include <string.h>\n\
         int cuInit(unsigned f) { return 0; }\n\
         int cuDeviceGetCount(int *n) { *n = 1; return 0; }\n\
         int cuDeviceGet(int *d, int i) { *d = i; return 0; }\n\
         int cuDeviceGetName(char *s, int n, int d) { strncpy(s, \"Fake GPU\", n); return 0; }\n\
         int cuDeviceTotalMem_v2(unsigned long *b, int d) { *b = 1UL << 30; return 0; }\n",
    );
    let out = train(&["--accelerator", "cuda", "--max-steps", "1"]);
    let needles: &[&str] = if cfg!(feature = "cuda") {
        &[
            "cuda device",
            "did not start: ",
            " (at ",
            "(see `train devices`)",
        ]
    } else {
        &["hardware.accelerator = \"cuda\"", "the `cuda` feature"]
    };
    assert_one_line_error(&out, needles);
    assert!(
        !dir.join("runs").exists(),
        "a refused run wrote its directory"
    );
}
