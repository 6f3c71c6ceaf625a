//! `cargo xtask tidy`: the house rules. What fails is where a concept lives: an import circle
//! between the files of a crate, a concrete strategy named outside the strategies, a model
//! family named outside its module and the registry, a command line's crate in the engine's
//! dependency tree, a top-level module of the engine or the program that ARCHITECTURE.md does
//! not name. Sizes are reported (the files past a screenful, the longest functions) and fail
//! only far past any one concept ([`FILE_LIMIT`], [`FN_LIMIT`]).
//!
//! The reading is a small Rust lexer (comments, strings, characters and lifetimes told apart),
//! not a compiler, and it is deliberately literal: a file imports the file whose module a path
//! names — `use crate::trainer::Plateau` imports `trainer/mod.rs`, wherever `Plateau` is
//! defined — so a `mod.rs` that re-exports its children and a child that takes a name back
//! through `super::` form a circle. Code under `#[cfg(test)]` is left out of everything.

mod concepts;
mod graph;
mod read;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

pub use graph::{Circle, circles};
use read::FileText;

use crate::common::Result;

/// The engine's sources (`kiln-engine`), from the workspace root.
pub const ENGINE_SRC: &str = "crates/engine/src";
/// The program's sources (`kiln`: `train`, `App`, the built-in recipes, launcher, plots).
pub const PROGRAM_SRC: &str = "crates/kiln/src";
/// The page that says where each concept lives, from the workspace root.
pub const ARCHITECTURE: &str = "ARCHITECTURE.md";
/// Every tree of sources the house rules reach, from the workspace root: each crate's, and
/// `xtask`'s own.
pub const TREES: [&str; 6] = [
    ENGINE_SRC,
    PROGRAM_SRC,
    "crates/generative/src",
    "models/src",
    "datasets/src",
    "xtask/src",
];
/// A file's non-test part longer than this is listed as past a screenful.
pub const FILE_LINES: usize = 500;
/// The longest a file's non-test part may be before `tidy` fails: far past one concept (the
/// listing at [`FILE_LINES`] is where to look first).
pub const FILE_LIMIT: usize = 800;
/// The longest a function may be before `tidy` fails: past two screens.
pub const FN_LIMIT: usize = 150;
/// The concrete strategies (`StrategyKind`'s variants but `Auto`): named only by the files of
/// [`STRATEGY_HOMES`], so that a new strategy is a new file there and nothing else.
pub const STRATEGIES: [&str; 7] = [
    "Single", "Ddp", "Zero1", "Zero2", "Zero3", "Pipeline", "Diloco",
];
/// Where the engine's files may name a concrete strategy: the strategies themselves and the
/// config that parses their names (the program's files may name none).
pub const STRATEGY_HOMES: [&str; 2] = ["strategy/", "config/"];

/// The one list of the model families (`families!`), from the workspace root.
pub const REGISTRY: &str = "models/src/registry.rs";
/// The models crate's root, which declares each family's module and re-exports its types.
pub const MODELS_ROOT: &str = "models/src/lib.rs";

/// A family as the registry lists it: `Llama => llama: crate::llama::Llama`.
#[derive(Debug, Clone, PartialEq)]
pub struct Family {
    /// Its module under `models/src` (`llama`: `llama.rs` or `llama/`).
    pub module: String,
    /// Its model type (`Llama`); its config is that name and `Config`.
    pub model: String,
}

impl Family {
    /// Whether `path` (from the workspace root) may name the family: its own module, the
    /// registry and the crate root.
    pub fn at_home(&self, path: &str) -> bool {
        let own = format!("models/src/{}", self.module);
        path == REGISTRY
            || path == MODELS_ROOT
            || path == format!("{own}.rs")
            || path.starts_with(&format!("{own}/"))
    }

    /// The identifiers that name it: its model and config types.
    pub fn names(&self) -> [String; 2] {
        [self.model.clone(), format!("{}Config", self.model)]
    }
}

/// The families of the registry's `families! { … }` list, whose lines read `Kind => field:
/// crate::module::Model,` (doc comments between them).
pub fn families(registry: &str) -> Vec<Family> {
    let Some(start) = registry.lines().position(|l| l.starts_with("families! {")) else {
        return Vec::new();
    };
    registry
        .lines()
        .skip(start + 1)
        .take_while(|l| !l.starts_with('}'))
        .filter_map(|line| {
            let (_, path) = line.trim().split_once(": crate::")?;
            let segments: Vec<&str> = path.trim_end_matches(',').split("::").collect();
            Some(Family {
                module: segments.first()?.to_string(),
                model: segments.last()?.to_string(),
            })
        })
        .collect()
}

/// What `tidy` found in one tree.
#[derive(Debug, Default)]
pub struct Shape {
    /// Each file (relative to the tree) with the files it imports.
    pub imports: BTreeMap<String, BTreeSet<String>>,
    /// Each file with the number of lines outside its `#[cfg(test)]` items.
    pub lines: BTreeMap<String, usize>,
    /// Every function outside test code: (lines, file, name, first line).
    pub functions: Vec<(usize, String, String, usize)>,
    /// Every `StrategyKind::X` outside test code naming a concrete strategy: (file, line, X).
    pub strategies: Vec<(String, usize, String)>,
    /// Each file with the identifiers outside its test code, and the first line of each.
    pub idents: BTreeMap<String, BTreeMap<String, usize>>,
}

/// `cargo xtask tidy`: prints, over every tree of [`TREES`], the import circles, the long
/// files and the five longest functions, the concrete strategies named outside
/// [`STRATEGY_HOMES`], the model families named outside their homes ([`Family::at_home`]),
/// the command line's crates in the engine's tree and the modules ARCHITECTURE.md does not
/// name; fails on any of them, and on a file past [`FILE_LIMIT`] or a function past
/// [`FN_LIMIT`].
pub fn run(root: &Path, layers: bool) -> Result<()> {
    let mut trees = Vec::new();
    for tree in TREES {
        trees.push((tree, read_tree(&root.join(tree))?));
    }
    if layers {
        print_layers(&trees[0].1);
    }
    let mut faults = Vec::new();
    let mut functions = Vec::new();
    let mut long = Vec::new();
    let mut circle_count = 0;
    for (tree, shape) in &trees {
        let found = circles(&shape.imports);
        println!(
            "import circles between the files of {tree}: {}",
            found.len()
        );
        for circle in &found {
            print_circle(shape, circle);
        }
        circle_count += found.len();
        functions.extend(
            shape
                .functions
                .iter()
                .map(|(n, file, name, line)| (*n, format!("{tree}/{file}"), name.clone(), *line)),
        );
        long.extend(
            shape
                .lines
                .iter()
                .filter(|(_, n)| **n > FILE_LINES)
                .map(|(file, n)| (*n, format!("{tree}/{file}"))),
        );
    }
    functions.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    println!(
        "files over {FILE_LINES} lines (tests left out): {}",
        long.len()
    );
    for (n, file) in &long {
        println!("  {n:5}  {file}");
    }
    println!("the five longest functions of the workspace:");
    for (n, file, name, line) in functions.iter().take(5) {
        println!("  {n:5}  {file}:{line} {name}");
    }
    let misplaced = strategies_out_of_place(&trees);
    println!(
        "concrete strategies named outside {ENGINE_SRC}/{{{}}}: {}",
        STRATEGY_HOMES.join(", "),
        misplaced.len()
    );
    for (file, line, name) in &misplaced {
        println!("  {file}:{line} StrategyKind::{name}");
    }
    let strays = concepts::engine_strays(root)?;
    println!(
        "a command line's crates ({}) in {}'s dependency tree: {}",
        concepts::COMMAND_LINE_CRATES.join(", "),
        concepts::ENGINE,
        strays.len()
    );
    for (name, by) in &strays {
        println!("  {name}, through {}", by.join(", "));
    }
    if !strays.is_empty() {
        faults.push(format!(
            "{} command-line crate(s) in the engine's tree",
            strays.len()
        ));
    }
    let unnamed = unnamed_modules(root)?;
    println!(
        "top-level modules of {ENGINE_SRC} and {PROGRAM_SRC} that {ARCHITECTURE} does not name: {}",
        unnamed.len()
    );
    for module in &unnamed {
        println!("  {module}");
    }
    if !unnamed.is_empty() {
        faults.push(format!(
            "{} module(s) missing from {ARCHITECTURE}",
            unnamed.len()
        ));
    }
    let registry = fs::read_to_string(root.join(REGISTRY))
        .map_err(|e| format!("cannot read {REGISTRY}: {e}"))?;
    let families = families(&registry);
    let strays = families_out_of_place(&families, &trees);
    println!(
        "model families ({}) named outside their modules, {REGISTRY} and {MODELS_ROOT}: {}",
        families.len(),
        strays.len()
    );
    for (file, line, name) in &strays {
        println!("  {file}:{line} {name}");
    }
    if families.is_empty() {
        faults.push(format!("no family read from {REGISTRY}'s families! list"));
    }
    if !strays.is_empty() {
        faults.push(format!(
            "{} model famil(ies) named outside their modules",
            strays.len()
        ));
    }
    if circle_count > 0 {
        faults.push(format!("{circle_count} import circle(s)"));
    }
    let too_long = long.iter().filter(|(n, _)| *n > FILE_LIMIT).count();
    if too_long > 0 {
        faults.push(format!("{too_long} file(s) over {FILE_LIMIT} lines"));
    }
    let fn_too_long = functions.iter().filter(|f| f.0 > FN_LIMIT).count();
    if fn_too_long > 0 {
        faults.push(format!("{fn_too_long} function(s) over {FN_LIMIT} lines"));
    }
    if !misplaced.is_empty() {
        faults.push(format!(
            "{} concrete strateg(ies) named outside the strategies",
            misplaced.len()
        ));
    }
    if faults.is_empty() {
        Ok(())
    } else {
        Err(format!("tidy: {}", faults.join(", ")))
    }
}

/// Where the engine names a concrete strategy outside [`STRATEGY_HOMES`], and where the
/// program names one at all: (file from the workspace root, line, name).
fn strategies_out_of_place(trees: &[(&str, Shape)]) -> Vec<(String, usize, String)> {
    let mut out = Vec::new();
    for (tree, shape) in trees {
        let homes: &[&str] = match *tree {
            ENGINE_SRC => &STRATEGY_HOMES,
            PROGRAM_SRC => &[],
            _ => continue,
        };
        for (file, line, name) in &shape.strategies {
            if !homes.iter().any(|h| file.starts_with(h)) {
                out.push((format!("{tree}/{file}"), *line, name.clone()));
            }
        }
    }
    out
}

/// The top-level modules of the engine and the program that ARCHITECTURE.md does not name.
fn unnamed_modules(root: &Path) -> Result<Vec<String>> {
    let read = |path: &str| {
        fs::read_to_string(root.join(path)).map_err(|e| format!("cannot read {path}: {e}"))
    };
    let architecture = read(ARCHITECTURE)?;
    let mut out = Vec::new();
    for tree in [ENGINE_SRC, PROGRAM_SRC] {
        let lib = read(&format!("{tree}/lib.rs"))?;
        out.extend(concepts::unnamed_modules(tree, &lib, &architecture));
    }
    Ok(out)
}

/// Where a file of `trees` names a family's model or config type outside its homes
/// ([`Family::at_home`]): (file, line, name).
fn families_out_of_place(
    families: &[Family],
    trees: &[(&str, Shape)],
) -> Vec<(String, usize, String)> {
    let mut out = Vec::new();
    for (tree, shape) in trees {
        for (file, idents) in &shape.idents {
            let path = format!("{tree}/{file}");
            for family in families.iter().filter(|f| !f.at_home(&path)) {
                for name in family.names() {
                    if let Some(line) = idents.get(&name) {
                        out.push((path.clone(), *line, name));
                    }
                }
            }
        }
    }
    out
}

/// One circle: its files, one loop, and what each of its files imports inside it.
fn print_circle(shape: &Shape, circle: &Circle) {
    println!(
        "  {} files; one loop: {}",
        circle.files.len(),
        circle.path.join(" -> ")
    );
    for file in &circle.files {
        let inside: Vec<&str> = shape.imports[file]
            .iter()
            .filter(|t| circle.files.contains(t))
            .map(String::as_str)
            .collect();
        println!("    {file} imports {}", inside.join(", "));
    }
}

/// Each top-level module of the crate (a file, or a folder) with the top-level modules its
/// files import: the layers as ARCHITECTURE.md draws them.
fn print_layers(shape: &Shape) {
    let top = |file: &str| {
        let first = file.split('/').next().unwrap_or(file);
        first.trim_end_matches(".rs").to_string()
    };
    let mut layers: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (file, targets) in &shape.imports {
        let from = top(file);
        let entry = layers.entry(from.clone()).or_default();
        for t in targets {
            let to = top(t);
            if to != from {
                entry.insert(to);
            }
        }
    }
    println!("layers of {ENGINE_SRC} (a module: the modules it imports):");
    for (module, imports) in &layers {
        let list: Vec<&str> = imports.iter().map(String::as_str).collect();
        println!("  {module}: {}", list.join(", "));
    }
}

/// Reads every `.rs` file under `dir`: imports between them, non-test lines, functions.
pub fn read_tree(dir: &Path) -> Result<Shape> {
    let mut files = Vec::new();
    collect(dir, dir, &mut files)?;
    let modules: BTreeMap<Vec<String>, String> = files
        .iter()
        .map(|rel| (module_of(rel), rel.clone()))
        .collect();
    let mut shape = Shape::default();
    let mut test_files = BTreeSet::new();
    let mut read = Vec::new();
    for rel in &files {
        let text = fs::read_to_string(dir.join(rel))
            .map_err(|e| format!("cannot read {}: {e}", dir.join(rel).display()))?;
        let file = FileText::read(&text);
        for child in &file.test_mods {
            let mut path = module_of(rel);
            path.push(child.clone());
            if let Some(f) = modules.get(&path) {
                test_files.insert(f.clone());
            }
        }
        read.push((rel.clone(), file));
    }
    for (rel, file) in read {
        if test_files.contains(&rel) {
            continue;
        }
        let here = module_of(&rel);
        let imports = shape.imports.entry(rel.clone()).or_default();
        // A binary's root is a crate of its own: its `crate::` is not this one.
        if !rel.starts_with("bin/") {
            for path in &file.paths {
                if let Some(target) = resolve(&here, path, &file.child_mods, &modules)
                    && target != rel
                {
                    imports.insert(target);
                }
            }
        }
        shape.lines.insert(rel.clone(), file.lines);
        for (line, name) in file.strategies {
            if STRATEGIES.contains(&name.as_str()) {
                shape.strategies.push((rel.clone(), line, name));
            }
        }
        for (name, line, len) in file.functions {
            shape.functions.push((len, rel.clone(), name, line));
        }
        let idents = shape.idents.entry(rel.clone()).or_default();
        for (line, name) in file.idents {
            idents.entry(name).or_insert(line);
        }
    }
    Ok(shape)
}

fn collect(base: &Path, dir: &Path, out: &mut Vec<String>) -> Result<()> {
    let entries =
        fs::read_dir(dir).map_err(|e| format!("cannot read directory {}: {e}", dir.display()))?;
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for path in paths {
        if path.is_dir() {
            collect(base, &path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(base).unwrap_or(&path);
            out.push(rel.to_string_lossy().replace('\\', "/"));
        }
    }
    Ok(())
}

/// The module path a file holds: `lib.rs` → [], `a/mod.rs` → [a], `a/b.rs` → [a, b].
fn module_of(rel: &str) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .trim_end_matches(".rs")
        .split('/')
        .map(String::from)
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// The file a path names: the longest prefix of its module path that is a file's module.
fn resolve(
    here: &[String],
    path: &[String],
    child_mods: &BTreeSet<String>,
    modules: &BTreeMap<Vec<String>, String>,
) -> Option<String> {
    let (mut module, rest): (Vec<String>, &[String]) = match path.first()?.as_str() {
        "crate" => (Vec::new(), &path[1..]),
        "self" => (here.to_vec(), &path[1..]),
        "super" => {
            let mut m = here.to_vec();
            let mut i = 0;
            while path.get(i).is_some_and(|s| s == "super") {
                m.pop();
                i += 1;
            }
            (m, &path[i..])
        }
        name if child_mods.contains(name) => (here.to_vec(), path),
        _ => return None,
    };
    let mut best = modules.get(&module).cloned();
    for seg in rest {
        module.push(seg.clone());
        if let Some(f) = modules.get(&module) {
            best = Some(f.clone());
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(edges: &[(&str, &str)]) -> BTreeMap<String, BTreeSet<String>> {
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in edges {
            g.entry(a.to_string()).or_default().insert(b.to_string());
            g.entry(b.to_string()).or_default();
        }
        g
    }

    #[test]
    fn circles_are_found_and_a_tree_has_none() {
        let tree = graph(&[("a", "b"), ("b", "c"), ("a", "c")]);
        assert!(circles(&tree).is_empty());
        let looped = graph(&[("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]);
        let found = circles(&looped);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].files, ["a", "b", "c"]);
        assert_eq!(found[0].path, ["a", "b", "c", "a"]);
    }

    #[test]
    fn paths_use_trees_tests_and_functions_are_read() {
        let text = r##"
mod child;
#[cfg(test)]
mod tests_file;
#[cfg(test)]
pub(crate) mod shared_tests;
use crate::{comm::{Collective, ReduceOp}, params::x as y};
use super::sibling::Thing;
// use crate::commented::Out;
const S: &str = "crate::in_string::No";
const R: &str = r#"crate::raw::No"#;
fn long<'a>(x: &'a u8) -> Vec<u8> where u8: Copy {
    let c = '{';
    child::go(crate::plain::call());
    vec![]
}
#[cfg(test)]
mod tests {
    use crate::only_in_tests::X;
    fn t() {}
}
"##;
        let f = FileText::read(text);
        let mut paths: Vec<String> = f.paths.iter().map(|p| p.join("::")).collect();
        paths.sort();
        assert_eq!(
            paths,
            [
                "child::go",
                "crate::comm::Collective",
                "crate::comm::ReduceOp",
                "crate::params::x",
                "crate::plain::call",
                "super::sibling::Thing"
            ]
        );
        assert_eq!(
            f.test_mods,
            BTreeSet::from(["shared_tests".to_string(), "tests_file".to_string()])
        );
        assert_eq!(f.functions, vec![("long".to_string(), 12, 5)]);
        assert_eq!(f.lines, text.lines().count() - 4 - 5);
    }

    #[test]
    fn a_path_names_the_deepest_file_module() {
        let modules: BTreeMap<Vec<String>, String> = [
            (vec![], "lib.rs"),
            (vec!["trainer".to_string()], "trainer/mod.rs"),
            (
                vec!["trainer".to_string(), "plateau".to_string()],
                "trainer/plateau.rs",
            ),
        ]
        .into_iter()
        .map(|(m, f)| (m, f.to_string()))
        .collect();
        let p = |s: &str| s.split("::").map(String::from).collect::<Vec<_>>();
        let none = BTreeSet::new();
        let here = module_of("trainer/plateau.rs");
        let at = |path: &str| resolve(&here, &p(path), &none, &modules);
        assert_eq!(
            at("crate::trainer::Plateau").as_deref(),
            Some("trainer/mod.rs")
        );
        assert_eq!(
            at("super::plateau::X").as_deref(),
            Some("trainer/plateau.rs")
        );
        assert_eq!(at("super::super::Thing").as_deref(), Some("lib.rs"));
        assert_eq!(at("std::fs").as_deref(), None);
    }

    #[test]
    fn a_concrete_strategy_named_outside_test_code_is_found() {
        let text = "fn f(k: StrategyKind) -> bool {\n    k == StrategyKind::Zero2 || k == StrategyKind::Auto\n}\n#[cfg(test)]\nmod tests {\n    const K: StrategyKind = StrategyKind::Ddp;\n}\n";
        let f = FileText::read(text);
        assert_eq!(
            f.strategies,
            [(2, "Zero2".to_string()), (2, "Auto".to_string())]
        );
        assert!(STRATEGIES.contains(&"Zero2") && !STRATEGIES.contains(&"Auto"));
    }

    #[test]
    fn the_registry_lists_each_family_with_its_module_and_type() {
        let text = "macro_rules! families {\n}\n\nfamilies! {\n    /// kiln's own.\n    Gpt => \
                    gpt: crate::gpt::Gpt,\n    Phi3 => phi3: crate::phi3::Phi3,\n}\n";
        let found = families(text);
        assert_eq!(
            found,
            [
                Family {
                    module: "gpt".into(),
                    model: "Gpt".into()
                },
                Family {
                    module: "phi3".into(),
                    model: "Phi3".into()
                }
            ]
        );
        let phi3 = &found[1];
        assert!(phi3.at_home("models/src/phi3/hf.rs") && phi3.at_home(REGISTRY));
        assert!(!phi3.at_home("models/src/load.rs") && !phi3.at_home("models/src/phi3x.rs"));
        assert!(found[0].at_home("models/src/gpt.rs"));
        // A file outside the family's homes that names its config is found, a line given.
        let mut shape = Shape::default();
        shape.idents.insert(
            "builtin/text.rs".into(),
            BTreeMap::from([("Phi3Config".to_string(), 7), ("Other".to_string(), 1)]),
        );
        let trees = [(PROGRAM_SRC, shape)];
        assert_eq!(
            families_out_of_place(&found, &trees),
            [(
                "crates/kiln/src/builtin/text.rs".to_string(),
                7,
                "Phi3Config".to_string()
            )]
        );
    }

    /// The check the project holds itself to: every rule of [`run`] over the workspace.
    #[test]
    fn kiln_keeps_its_shape() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("workspace root");
        if let Err(e) = run(root, false) {
            panic!("{e} (cargo xtask tidy lists them)");
        }
    }
}
