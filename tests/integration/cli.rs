//! The `train` command line: every kind of bad input gets one clear line and a non-zero exit.

use std::io::Write;

use crate::common::{assert_one_line_error, temp_dir, train_bin};

#[test]
fn unknown_config_key_on_the_command_line() {
    let dir = temp_dir("unknown-key");
    let out = train_bin(&dir, &["--set", "train.epoch=3"]);
    assert_one_line_error(&out, &["train.epoch"]);
}

#[test]
fn unknown_config_key_in_a_file_names_file_and_key() {
    let dir = temp_dir("unknown-key-file");
    let path = dir.join("bad.toml");
    std::fs::write(&path, "[optim]\nlearning_rate = 0.1\n").unwrap();
    let out = train_bin(&dir, &["--config", "bad.toml"]);
    assert_one_line_error(&out, &["bad.toml", "optim.learning_rate"]);
    // A key inside a section is not a section: no list of sections.
    assert!(!String::from_utf8_lossy(&out.stderr).contains("the program's"));
    // A section misspelt: the sections a config has are listed, the program's among them.
    std::fs::write(&path, "[dta]\npath = \"x\"\n").unwrap();
    let out = train_bin(&dir, &["--config", "bad.toml"]);
    assert_one_line_error(&out, &["bad.toml", "`dta`", "`train`", "`data`", "`model`"]);
}

#[test]
fn wrong_type_names_key_and_expected_type() {
    let dir = temp_dir("wrong-type");
    let out = train_bin(&dir, &["--set", "train.batch_size=big"]);
    assert_one_line_error(&out, &["train.batch_size", "integer"]);
}

#[test]
fn a_key_of_a_few_names_lists_them_and_a_switch_takes_a_boolean() {
    let dir = temp_dir("enum-key");
    // What the value was and what the key takes; the source is the `--set` that gave it,
    // not the recipe it overrides.
    let out = train_bin(&dir, &["--set", "dist.overlap=maybe"]);
    assert_one_line_error(
        &out,
        &[
            "--set dist.overlap=maybe:",
            "dist.overlap",
            r#"expected one of "auto", "on", "off""#,
        ],
    );
    let out = train_bin(&dir, &["--set", "precision.mode=16"]);
    assert_one_line_error(
        &out,
        &[
            "--set precision.mode=16:",
            "precision.mode",
            r#""bf16-mixed""#,
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("built-in"), "{stderr}");
    // A value from a file names the file; a flag names the flag.
    std::fs::write(dir.join("bad.toml"), "[dist]\noverlap = 3\n").unwrap();
    let out = train_bin(&dir, &["--config", "bad.toml"]);
    assert_one_line_error(
        &out,
        &["bad.toml:", "dist.overlap", r#""auto""#, "got integer `3`"],
    );
    let out = train_bin(&dir, &["--batch-size", "0"]);
    assert_one_line_error(&out, &["--batch-size 0:", "train.batch_size"]);
    // A boolean is what people type for a switch.
    for (set, shown) in [
        ("dist.overlap=true", "overlap = \"on\""),
        ("dist.overlap=false", "overlap = \"off\""),
        ("hardware.cpu_split=false", "cpu_split = \"off\""),
    ] {
        let out = train_bin(&dir, &["--set", set, "--print-config"]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{set}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains(shown), "{set}: {stdout}");
    }
}

#[test]
fn zero_devices_is_rejected() {
    let dir = temp_dir("zero-devices");
    let out = train_bin(&dir, &["--devices", "0"]);
    assert_one_line_error(&out, &["hardware.devices", "at least one device"]);
    let out = train_bin(&dir, &["--devices", "two"]);
    assert_one_line_error(&out, &["--devices", "two"]);
}

#[test]
fn missing_data_directory() {
    let dir = temp_dir("missing-data");
    let out = train_bin(
        &dir,
        &[
            "--set",
            "data.dataset=mnist",
            "--set",
            "data.dir=/no/such/mnist",
        ],
    );
    assert_one_line_error(&out, &["/no/such/mnist", "does not exist"]);
}

fn write_idx(path: &std::path::Path, header: &[u32], body: &[u8]) {
    let mut f = std::fs::File::create(path).unwrap();
    for h in header {
        f.write_all(&h.to_be_bytes()).unwrap();
    }
    f.write_all(body).unwrap();
}

/// A directory with all four MNIST files valid (tiny) except as `spoil` makes them.
fn idx_dir(name: &str, spoil: impl Fn(&std::path::Path)) -> crate::common::TestDir {
    let dir = temp_dir(name);
    for (split, n) in [("train", 4u32), ("t10k", 2u32)] {
        write_idx(
            &dir.join(format!("{split}-images-idx3-ubyte")),
            &[0x803, n, 28, 28],
            &vec![0u8; (n * 28 * 28) as usize],
        );
        write_idx(
            &dir.join(format!("{split}-labels-idx1-ubyte")),
            &[0x801, n],
            &vec![1u8; n as usize],
        );
    }
    spoil(&dir);
    dir
}

#[test]
fn truncated_idx_file() {
    let dir = idx_dir("truncated", |d| {
        write_idx(
            &d.join("train-images-idx3-ubyte"),
            &[0x803, 4, 28, 28],
            &[0u8; 100],
        );
    });
    let out = train_bin(
        &dir,
        &[
            "--set",
            "data.dataset=mnist",
            "--set",
            &format!("data.dir={:?}", dir.display().to_string()),
        ],
    );
    assert_one_line_error(&out, &["train-images-idx3-ubyte", "truncated"]);
}

#[test]
fn wrong_magic_idx_file() {
    let dir = idx_dir("magic", |d| {
        write_idx(&d.join("t10k-labels-idx1-ubyte"), &[0x1234, 2], &[1, 1]);
    });
    let out = train_bin(
        &dir,
        &[
            "--set",
            "data.dataset=mnist",
            "--set",
            &format!("data.dir={:?}", dir.display().to_string()),
        ],
    );
    assert_one_line_error(&out, &["t10k-labels-idx1-ubyte", "magic"]);
}

#[test]
fn corrupt_checkpoint_is_reported_on_resume() {
    let dir = temp_dir("corrupt-ckpt");
    let run = dir.join("run");
    let out = train_bin(
        &dir,
        &[
            "--run-dir",
            "run",
            "--max-steps",
            "2",
            "--set",
            "model.convnet.channels=[2, 2]",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (_, ckpt) = kiln::checkpoint::latest(&run).unwrap();
    std::fs::write(ckpt.join("model.bpk"), b"not a burnpack file").unwrap();
    let out = train_bin(&dir, &["--resume", "run"]);
    assert_one_line_error(&out, &["model.bpk", "corrupt"]);

    std::fs::write(ckpt.join("state.json"), b"{").unwrap();
    let out = train_bin(&dir, &["--resume", "run"]);
    assert_one_line_error(&out, &["state.json"]);

    let out = train_bin(&dir, &["--resume", "no-such-run"]);
    assert_one_line_error(&out, &["no-such-run"]);
}

#[test]
fn print_config_round_trips() {
    let dir = temp_dir("print-config");
    let out = train_bin(&dir, &["--print-config", "--devices", "0,2", "--lr", "0.5"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let printed = |text: &str| {
        kiln::builtin::Config::from_table(toml::from_str(text).unwrap(), "stdout").unwrap()
    };
    let config = printed(&text).kiln;
    assert_eq!(config.hardware.devices.indices(), vec![0, 2]);
    assert_eq!(config.optim.lr, 0.5);
    assert_eq!(config.run.name, "digits-convnet");
    // The file in configs/ and the built-in default are the same recipe.
    let file = kiln::builtin::load(
        Some(std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../configs/digits-convnet.toml"
        ))),
        &[],
    )
    .unwrap();
    let out = train_bin(&dir, &["--print-config"]);
    let builtin = printed(&String::from_utf8(out.stdout).unwrap());
    assert_eq!(file, builtin);
}

#[test]
fn every_shipped_recipe_is_valid() {
    let configs = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs"));
    let mut n = 0;
    for entry in std::fs::read_dir(configs).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        // The recipes of crates/generative's programs have their own [model] and [data].
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let table =
            || -> toml::Table { toml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap() };
        let origin = path.display().to_string();
        let checked = if name.starts_with("gan-") {
            kiln::UserConfig::<
                kiln_generative::gan::GanConfig,
                kiln_generative::data::DataConfig,
            >::from_table(table(), &origin)
            .map(|_| ())
        } else if name.starts_with("autoencoder-") {
            kiln::UserConfig::<
                kiln_generative::autoencoder::AutoencoderConfig,
                kiln_generative::data::DataConfig,
            >::from_table(table(), &origin)
            .map(|_| ())
        } else {
            kiln::builtin::load(Some(&path), &[]).map(|_| ())
        };
        checked.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        n += 1;
    }
    assert!(n >= 9, "expected the nine recipes, found {n}");
}

#[test]
fn devices_report_lists_the_cpu_and_the_auto_choice() {
    let dir = temp_dir("devices");
    let out = train_bin(&dir, &["devices"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.lines().any(|l| l.starts_with("cpu ")), "{text}");
    assert!(text.lines().any(|l| l.starts_with("wgpu ")), "{text}");
    assert!(text.contains("--accelerator auto chooses"), "{text}");
    // More adapters than the machine has is a clear error, not a panic.
    let out = train_bin(&dir, &["--accelerator", "wgpu", "--devices", "0,7"]);
    assert_one_line_error(&out, &["wgpu adapter 7"]);
}

#[cfg(not(feature = "mpi"))]
#[test]
fn several_processes_without_the_mpi_feature_are_refused() {
    // What mpirun puts in each process's environment; this build cannot join them.
    let dir = temp_dir("no-mpi");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
        .args(["--max-steps", "1"])
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .env("OMPI_COMM_WORLD_RANK", "0")
        .current_dir(&dir)
        .output()
        .unwrap();
    assert_one_line_error(&out, &["process 0 of 2", "mpi", "--features kiln/mpi"]);
    assert!(!dir.join("runs").exists(), "nothing is written");
}

#[test]
fn a_reader_that_goes_away_costs_the_lines_not_the_run() {
    use std::io::BufRead;
    let dir = temp_dir("closed-stdout");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
        .args([
            "--config",
            "/dev/null",
            "--run-dir",
            "run",
            "--max-steps",
            "30",
            "--set",
            "data.dataset=\"digits\"",
            "--set",
            "train.epochs=0",
            "--set",
            "train.log_every=1",
            "--set",
            "monitor.interval_s=0",
        ])
        .current_dir(&dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Read the first line, then close the pipe as `train | head -1` would.
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(dir.join("run").join("summary.json").exists());
}

/// The command line's conventions: `--version` with the commit, completion scripts for the
/// shells clap knows, and a manual page.
#[test]
fn version_completions_and_manual_page() {
    let dir = temp_dir("cli-conventions");
    let out = train_bin(&dir, &["--version"]);
    assert!(out.status.success());
    let version = String::from_utf8_lossy(&out.stdout);
    assert!(
        version.starts_with(&format!("train {} (", env!("CARGO_PKG_VERSION"))),
        "{version}"
    );
    // Inside a checkout (the suite's usual place) the version names the checkout's commit;
    // "no commit" only where git finds none.
    let head = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    match head {
        Some(commit) => assert!(version.contains(&format!("commit {commit}")), "{version}"),
        None => assert!(version.contains("no commit"), "{version}"),
    }
    let script = |shell: &str| {
        let out = train_bin(&dir, &["completions", shell]);
        assert!(out.status.success(), "{shell}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let bash = script("bash");
    assert!(
        bash.contains("_train()") && bash.contains("complete -F _train"),
        "{bash}"
    );
    // Every subcommand and flag is offered, the program's own `sample` among them.
    for word in ["launch", "plan", "sample", "--resume", "--strategy"] {
        assert!(bash.contains(word), "bash completion lacks {word}");
    }
    assert!(script("zsh").contains("#compdef train"));
    assert!(script("fish").contains("complete -c train"));
    let out = train_bin(&dir, &["completions", "tcsh"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("tcsh"));
    let out = train_bin(&dir, &["man"]);
    assert!(out.status.success());
    let man = String::from_utf8_lossy(&out.stdout);
    assert!(man.contains(".TH train") && man.contains("launch"), "{man}");
    // A reader that closes its end at once (`| grep -q`, `| head -1`) ends the output quietly.
    for args in [["completions", "bash"], ["man", ""]] {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
            .args(args.iter().filter(|a| !a.is_empty()))
            .current_dir(&dir)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}
