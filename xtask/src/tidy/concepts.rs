//! The house rules about where things live, beside the reading of the sources: the engine
//! built without the command line's crates (its dependency tree, from `cargo tree`), and every
//! top-level module of the engine and the program named in ARCHITECTURE.md.

use std::env;
use std::path::Path;
use std::process::Command;

use crate::common::{Result, run_captured};

/// The engine crate, which a program embeds to train.
pub const ENGINE: &str = "kiln-engine";
/// The crates of a command line, its plots and its GPU samples: none may be in the engine's
/// dependency tree with its default features (`clap` and `nvml` are features of its own that
/// kiln's `train` turns on).
pub const COMMAND_LINE_CRATES: [&str; 6] = [
    "clap",
    "clap_complete",
    "clap_mangen",
    "plotters",
    "png",
    "nvml-wrapper",
];
/// The one crate that may bring `nvml-wrapper` into the engine's tree: Burn's CubeCL runtime
/// samples GPUs through it (its WGPU backend turns NVML on), which no feature of kiln's turns
/// off.
pub const NVML_THROUGH: &str = "cubecl-monitoring";

/// The crates of [`COMMAND_LINE_CRATES`] in the engine's tree (`cargo tree -p kiln-engine -e
/// normal`), each with the crates that bring it in, leaving out `nvml-wrapper` where only
/// [`NVML_THROUGH`] does.
pub fn engine_strays(root: &Path) -> Result<Vec<(String, Vec<String>)>> {
    let tree = cargo_tree(root, &["-e", "normal", "--prefix", "none", "-f", "{p}"])?;
    let present = crate_names(&tree);
    let mut strays = Vec::new();
    for name in COMMAND_LINE_CRATES {
        if !present.iter().any(|p| p == name) {
            continue;
        }
        let parents = cargo_tree(
            root,
            &[
                "-e", "normal", "-i", name, "--depth", "1", "--prefix", "none", "-f", "{p}",
            ],
        )?;
        let by: Vec<String> = crate_names(&parents)
            .into_iter()
            .filter(|p| p != name)
            .collect();
        if name == "nvml-wrapper" && by.iter().all(|p| p == NVML_THROUGH) {
            continue;
        }
        strays.push((name.to_string(), by));
    }
    Ok(strays)
}

/// `cargo tree -p kiln-engine` with `args`, from `root`, offline (what it reads is what the
/// build fetched).
fn cargo_tree(root: &Path, args: &[&str]) -> Result<String> {
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    command
        .current_dir(root)
        .args(["tree", "--offline", "-p", ENGINE])
        .args(args);
    run_captured(&mut command, "cargo tree -p kiln-engine")
}

/// The crate names of `cargo tree`'s lines (`name v1.2.3 (path)`), each once.
pub fn crate_names(tree: &str) -> Vec<String> {
    let mut names: Vec<String> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(String::from)
        .collect();
    names.sort();
    names.dedup();
    names
}

/// The top-level modules a crate root declares (`mod x;`, `pub mod x;`, `pub(crate) mod x;`),
/// test modules left out.
pub fn root_modules(lib: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut test_next = false;
    for line in lib.lines().map(str::trim) {
        if line.starts_with("#[cfg(test)]") {
            test_next = true;
            continue;
        }
        let decl = line
            .strip_prefix("pub(crate) ")
            .or_else(|| line.strip_prefix("pub "))
            .unwrap_or(line);
        if let Some(name) = decl.strip_prefix("mod ").and_then(|r| r.strip_suffix(';'))
            && !test_next
        {
            out.push(name.to_string());
        }
        if !line.starts_with("#[") {
            test_next = false;
        }
    }
    out
}

/// The modules of `lib` (a crate root under `tree`) that `architecture` names neither as
/// `name.rs` nor as `name/`.
pub fn unnamed_modules(tree: &str, lib: &str, architecture: &str) -> Vec<String> {
    root_modules(lib)
        .into_iter()
        .filter(|m| !architecture.contains(&format!("{m}.rs")))
        .filter(|m| !architecture.contains(&format!("{m}/")))
        .map(|m| format!("{tree}/{m}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crate_roots_modules_are_read_and_those_unnamed_found() {
        let lib = "//! doc\nmod a;\npub mod b;\npub(crate) mod c;\n#[cfg(test)]\nmod tests;\n\
                   #[cfg(feature = \"x\")]\nmod d;\nuse a::X;\n";
        assert_eq!(root_modules(lib), ["a", "b", "c", "d"]);
        let architecture = "| a | `a.rs` | … | `b/` (`b/x.rs`) |";
        assert_eq!(
            unnamed_modules("crates/engine/src", lib, architecture),
            ["crates/engine/src/c", "crates/engine/src/d"]
        );
    }

    #[test]
    fn cargo_trees_lines_give_crate_names_once() {
        let tree = "kiln-engine v0.1.0 (/x)\nburn v0.22.1\nclap v4.5.0\nburn v0.22.1\n";
        assert_eq!(crate_names(tree), ["burn", "clap", "kiln-engine"]);
    }
}
