//! The README and the guide (`docs/src`) stay true: every command of a block marked
//! `sh,tested` runs (the built `train`, in a directory of its own per page, with the
//! checkout's `configs/`), every other shell block is listed in [`NOT_RUN`] with why, every
//! `train` flag, subcommand and `--set` key a page names exists, every config key and
//! checkout path a page names in code exists, and every link between the pages (and into the
//! checkout) lands on a file, and on a heading where it names one.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::common::{temp_dir, train_bin_kept};

/// The shell blocks the tests do not run, each named by its page and a piece of its text,
/// with why. A block that is neither marked `sh,tested` nor listed here fails the test, as
/// does an entry that matches no block.
const NOT_RUN: &[(&str, &str, &str)] = &[
    (
        "examples.md",
        "data.dataset=\"instruct\"",
        "needs a checkpoint and examples of one's own: the chat:: tests fine-tune the fixtures",
    ),
    (
        "examples.md",
        "fetch-data sotu-instruct",
        "the recipe trains a base for minutes (npm's package fetched): BENCHMARKS.md has its runs",
    ),
    (
        "README.md",
        "cargo run --release --bin train",
        "the README's two commands: CI runs the tests itself, and the first trains 10 epochs",
    ),
    (
        "README.md",
        "cargo install --path crates/kiln",
        "installs from the checkout: CI does it from another directory",
    ),
    (
        "README.md",
        "cargo xtask fetch-data text",
        "needs Moby-Dick from the npm registry and minutes of training",
    ),
    (
        "data.md",
        "cargo xtask fetch-data text",
        "needs Moby-Dick from the npm registry and minutes of training",
    ),
    (
        "pipeline.md",
        "--config configs/gpt-text.toml",
        "needs Moby-Dick; the digits block above runs the same strategy",
    ),
    (
        "tensor.md",
        "--config configs/gpt-text.toml",
        "needs Moby-Dick: the tp:: tests run the same meshes on a small text",
    ),
    (
        "processes.md",
        "mpirun -np 2 target/release/train",
        "needs the mpi feature and mpirun: the mpi:: tests run such jobs in CI",
    ),
    (
        "processes.md",
        "--strategy diloco",
        "needs several machines",
    ),
    (
        "planning.md",
        "train plan --config configs/gpt-text.toml",
        "needs Moby-Dick; the digits block below plans the same way",
    ),
    (
        "gpus.md",
        "cargo xtask setup-cuda",
        "a 13-minute build: CI runs it separately (the cuda lints and tests)",
    ),
    (
        "monitoring.md",
        "train plot runs/NAME",
        "a synopsis: the block above plots a real run",
    ),
    (
        "monitoring.md",
        "--name gpt-plot",
        "500 steps of the GPT on Moby-Dick",
    ),
    ("finetune.md", "", "no shell block"),
    (
        "huggingface.md",
        "configs/llama-finetune.toml",
        "needs a real checkpoint and text; tests/integration/hf.rs fine-tunes the fixtures",
    ),
];

/// Flags a page names that belong to other programs than `train`.
const OTHER_FLAGS: &[(&str, &str)] = &[
    ("--example", "cargo run"),
    ("--features", "cargo build"),
    ("--ignored", "cargo test"),
    ("--size", "kiln-image-folder"),
    ("--jpeg", "kiln-image-folder"),
    ("--idx", "kiln-image-folder"),
    ("--layers", "cargo xtask tidy"),
    ("--check", "xtask/reference/hf_fixtures.py"),
];

/// Config keys a page names that `train` does not have, with why.
const NOT_TRAIN_KEYS: &[(&str, &str)] = &[
    (
        "model.sample_every",
        "the GAN's own [model] section (crates/generative)",
    ),
    ("groups.discriminator", "a group the GAN names"),
    ("groups.generator", "a group the GAN names"),
    ("model.hiden", "the misspelt key of an error's example"),
];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The README and every page of the guide, as (name, path, text).
fn pages() -> Vec<(String, PathBuf, String)> {
    let root = workspace();
    let mut out = vec![(
        "README.md".to_string(),
        root.join("README.md"),
        std::fs::read_to_string(root.join("README.md")).unwrap(),
    )];
    let mut guide: Vec<PathBuf> = std::fs::read_dir(root.join("docs/src"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    guide.sort();
    for p in guide {
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        let text = std::fs::read_to_string(&p).unwrap();
        out.push((name, p, text));
    }
    out
}

/// A fenced block: its info string, its text and the line it starts on.
struct Fence {
    info: String,
    body: String,
    line: usize,
}

/// The fenced blocks of a page, and the page's text outside them.
fn fences(text: &str) -> (Vec<Fence>, String) {
    let mut out = Vec::new();
    let mut prose = String::new();
    let mut open: Option<Fence> = None;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if let Some(rest) = trimmed.strip_prefix("```") {
            match open.take() {
                Some(f) => out.push(f),
                None => {
                    open = Some(Fence {
                        info: rest.trim().to_string(),
                        body: String::new(),
                        line: i + 1,
                    })
                }
            }
            continue;
        }
        match open.as_mut() {
            Some(f) => {
                f.body.push_str(line);
                f.body.push('\n');
            }
            None => {
                prose.push_str(line);
                prose.push('\n');
            }
        }
    }
    assert!(open.is_none(), "a fenced block is not closed");
    (out, prose)
}

/// The commands of a shell block: continuation lines joined, comments dropped, each line
/// split into words as a shell would (quotes removed); a trailing `> FILE` kept as two words.
fn commands(body: &str) -> Vec<Vec<String>> {
    let joined = body.replace("\\\n", " ");
    joined
        .lines()
        .map(words)
        .filter(|w| !w.is_empty())
        .collect()
}

fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '#' if !in_word => break,
            ' ' | '\t' | '\n' => {
                if in_word {
                    out.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            '\'' => {
                in_word = true;
                for q in chars.by_ref() {
                    if q == '\'' {
                        break;
                    }
                    word.push(q);
                }
            }
            '"' => {
                in_word = true;
                while let Some(q) = chars.next() {
                    match q {
                        '"' => break,
                        '\\' => word.extend(chars.next()),
                        q => word.push(q),
                    }
                }
            }
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        out.push(word);
    }
    out
}

/// A `train` command's arguments where `words` runs it (`train …`, `target/release/train …`,
/// `cargo run … --bin train -- …`, `mpirun … train …`); `None` for another program.
fn train_args(words: &[String]) -> Option<Vec<String>> {
    if words.first().is_some_and(|w| w == "cargo") {
        let bin = words
            .windows(2)
            .position(|w| w[0] == "--bin" && w[1] == "train")?;
        let rest = &words[bin + 2..];
        return Some(match rest.iter().position(|w| w == "--") {
            Some(i) => rest[i + 1..].to_vec(),
            None => Vec::new(),
        });
    }
    let at = words
        .iter()
        .position(|w| w == "train" || w.ends_with("/train"))?;
    Some(words[at + 1..].to_vec())
}

/// `train --help` and each subcommand's, by subcommand ("" for `train` itself).
fn helps() -> &'static BTreeMap<String, String> {
    static HELPS: OnceLock<BTreeMap<String, String>> = OnceLock::new();
    HELPS.get_or_init(|| {
        let help = |args: &[&str]| {
            let out = Command::new(env!("CARGO_BIN_EXE_train"))
                .args(args)
                .output()
                .unwrap();
            assert!(out.status.success(), "train {args:?}");
            String::from_utf8_lossy(&out.stdout).to_string()
        };
        let main = help(&["--help"]);
        let mut all = BTreeMap::new();
        let commands = main
            .split("Commands:")
            .nth(1)
            .and_then(|s| s.split("Options:").next())
            .unwrap_or_default();
        for line in commands.lines() {
            if let Some(name) = line.split_whitespace().next()
                && line.starts_with("  ")
                && !line.starts_with("   ")
                && name != "help"
            {
                all.insert(name.to_string(), help(&[name, "--help"]));
            }
        }
        all.insert(String::new(), main);
        all
    })
}

/// The long flags a help text names, without their dashes: every word that starts with
/// `--`, cut at the first character a flag's name cannot hold (`--max-steps <N>`,
/// `[--devices]`), so that a flag is found only by its whole name (`--max` is not
/// `--max-steps`).
fn flags_of(help: &str) -> BTreeSet<String> {
    help.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter_map(|w| w.strip_prefix("--"))
        .map(|name| name.trim_end_matches('-').to_string())
        .filter(|name| !name.is_empty() && !name.starts_with('-'))
        .collect()
}

/// Whether `train` has config key `key`, asked of `train --print-config --set KEY=0`: the key
/// exists where that succeeds, or where it refuses the value of exactly this key (`key
/// `KEY`: …`) for another reason than an unknown field. A refusal that names a shorter key
/// (`train.max_steps.x` ends at `train.max_steps`, an integer) or that is no configuration
/// error at all says it does not.
fn has_key(key: &str) -> bool {
    let out = Command::new(env!("CARGO_BIN_EXE_train"))
        .args(["--print-config", "--set", &format!("{key}=0")])
        .output()
        .unwrap();
    if out.status.success() {
        return true;
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    stderr.contains(&format!("key `{key}`: ")) && !stderr.contains("unknown field")
}

/// The problems of one `train` command's names: flags its (sub)command lacks, `--set` keys.
fn check_train_command(args: &[String], keys: &mut BTreeSet<String>) -> Vec<String> {
    let helps = helps();
    let mut faults = Vec::new();
    let (sub, mut rest) = match args.first() {
        Some(a) if helps.contains_key(a.as_str()) => (a.clone(), &args[1..]),
        _ => (String::new(), args),
    };
    let mut help = &helps[&sub];
    let mut i = 0;
    while i < rest.len() {
        let w = &rest[i];
        if w == "--" {
            // `train launch … -- TRAIN_ARGS`: the rest is train's own.
            rest = &rest[i + 1..];
            help = &helps[""];
            i = 0;
            continue;
        }
        if let Some(flag) = w.strip_prefix("--") {
            let flag = flag.split('=').next().unwrap();
            if !flags_of(help).contains(flag) {
                faults.push(format!(
                    "`{}` has no flag --{flag}",
                    format!("train {sub}").trim_end()
                ));
            }
            if flag == "set"
                && let Some(kv) = rest.get(i + 1)
            {
                keys.insert(kv.split('=').next().unwrap().to_string());
            }
        }
        i += 1;
    }
    faults
}

/// Inline code spans of a page's prose.
fn spans(prose: &str) -> Vec<String> {
    prose
        .split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, s)| s.to_string())
        .collect()
}

const SECTIONS: &[&str] = &[
    "run",
    "data",
    "model",
    "train",
    "optim",
    "schedule",
    "hardware",
    "strategy",
    "pipeline",
    "diloco",
    "ddp",
    "dist",
    "monitor",
    "precision",
    "recompute",
    "init",
    "finetune",
    "export",
    "groups",
];
const FILE_ENDINGS: &[&str] = &[
    "toml",
    "json",
    "jsonl",
    "bpk",
    "safetensors",
    "csv",
    "png",
    "rs",
    "txt",
    "pt",
    "pth",
    "md",
    "py",
    "c",
    "sh",
    "lock",
];

/// A config key an inline span names (`train.max_steps`, `[schedule.plateau]`).
fn key_in(span: &str) -> Option<String> {
    let s = span.trim_start_matches('[').trim_end_matches(']');
    let s = s.split(['=', ' ']).next()?;
    let parts: Vec<&str> = s.split('.').collect();
    let word = |p: &&str| {
        !p.is_empty()
            && p.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    };
    (parts.len() >= 2
        && parts.iter().all(word)
        && SECTIONS.contains(&parts[0])
        && !FILE_ENDINGS.contains(parts.last().unwrap()))
    .then(|| s.to_string())
}

/// A checkout path an inline span names (`configs/gpt-text.toml`, `scripts/two-hosts`).
fn path_in(span: &str) -> Option<String> {
    let top = [
        "configs/",
        "scripts/",
        "crates/",
        "models/",
        "datasets/",
        "xtask/",
        "tests/",
        "docs/",
    ];
    let s = span.split_whitespace().next()?;
    (top.iter().any(|t| s.starts_with(t))
        && !s.contains(['*', '<', '{'])
        && !s.contains("NAME")
        && !s.contains("step-N"))
    .then(|| s.trim_end_matches([',', '.', ':', ')']).to_string())
}

/// Markdown links `[text](target)` of a page's prose.
fn links(prose: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = prose;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else { break };
        out.push(after[..end].to_string());
        rest = &after[end..];
    }
    out
}

/// mdBook's anchor of a heading: lower case, spaces to `-`, other punctuation dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(path: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let (_, prose) = fences(&text);
    prose
        .lines()
        .filter(|l| l.starts_with('#'))
        .map(|l| anchor(l.trim_start_matches('#')))
        .collect()
}

#[test]
fn the_pages_name_what_exists_and_link_where_they_say() {
    let root = workspace();
    let mut faults = Vec::new();
    let mut keys = BTreeSet::new();
    let mut listed = vec![false; NOT_RUN.len()];
    for (name, path, text) in pages() {
        let (blocks, prose) = fences(&text);
        for f in &blocks {
            let shell = f.info.starts_with("sh") || f.info.starts_with("bash");
            if !shell {
                continue;
            }
            let tested = f.info.split(',').any(|t| t == "tested");
            if !tested {
                let hit = NOT_RUN
                    .iter()
                    .position(|(p, piece, _)| *p == name && f.body.contains(piece));
                match hit {
                    Some(i) => listed[i] = true,
                    None => faults.push(format!(
                        "{name}:{}: a shell block neither `sh,tested` nor listed in NOT_RUN",
                        f.line
                    )),
                }
            }
            for words in commands(&f.body) {
                if let Some(args) = train_args(&words) {
                    for fault in check_train_command(&args, &mut keys) {
                        faults.push(format!("{name}:{}: {fault}", f.line));
                    }
                }
            }
        }
        for span in spans(&prose) {
            if let Some(flag) = span.strip_prefix("--") {
                let flag = format!(
                    "--{}",
                    flag.split(|c: char| c.is_whitespace() || c == '=')
                        .next()
                        .unwrap()
                );
                let other = OTHER_FLAGS.iter().any(|(f, _)| *f == flag);
                let known = helps().values().any(|h| flags_of(h).contains(&flag[2..]));
                if flag != "--" && !other && !known {
                    faults.push(format!("{name}: no train command has {flag}"));
                }
            }
            if span.starts_with("train ") || span.contains("--bin train") {
                let args = train_args(&words(&span)).unwrap_or_default();
                for fault in check_train_command(&args, &mut keys) {
                    faults.push(format!("{name}: `{span}`: {fault}"));
                }
            }
            if let Some(k) = key_in(&span) {
                keys.insert(k);
            }
            if let Some(p) = path_in(&span)
                && !root.join(&p).exists()
            {
                faults.push(format!("{name}: `{p}` is not in the checkout"));
            }
        }
        let dir = path.parent().unwrap();
        for target in links(&prose) {
            if target.starts_with("http") || target.starts_with("mailto:") {
                continue;
            }
            let (file, hash) = match target.split_once('#') {
                Some((f, h)) => (f, Some(h)),
                None => (target.as_str(), None),
            };
            let file = if file.is_empty() {
                path.clone()
            } else {
                dir.join(file)
            };
            if !file.exists() {
                faults.push(format!("{name}: link to `{target}`: no such file"));
            } else if let Some(h) = hash
                && !anchors(&file).contains(h)
            {
                faults.push(format!("{name}: link to `{target}`: no such heading"));
            }
        }
        for include in text.split("{{#include ").skip(1) {
            let target = include.split("}}").next().unwrap().trim();
            if !dir.join(target).exists() {
                faults.push(format!("{name}: includes `{target}`: no such file"));
            }
        }
    }
    for (i, (page, piece, _)) in NOT_RUN.iter().enumerate() {
        if !listed[i] && !piece.is_empty() {
            faults.push(format!("NOT_RUN lists `{piece}` on {page}: no such block"));
        }
    }
    for key in keys {
        let known = NOT_TRAIN_KEYS
            .iter()
            .any(|(k, _)| key == *k || key.starts_with(&format!("{k}.")));
        if !known && !has_key(&key) {
            faults.push(format!("`{key}` is not a config key of train"));
        }
    }
    assert!(faults.is_empty(), "{}", faults.join("\n"));
}

#[test]
fn the_tested_commands_of_every_page_run() {
    let root = workspace();
    for (name, _, text) in pages() {
        let (blocks, _) = fences(&text);
        let tested: Vec<&Fence> = blocks
            .iter()
            .filter(|f| f.info.split(',').any(|t| t == "tested"))
            .collect();
        if tested.is_empty() {
            continue;
        }
        let dir = temp_dir(&format!("docs-{}", name.trim_end_matches(".md")));
        std::os::unix::fs::symlink(root.join("configs"), dir.join("configs")).unwrap();
        for f in tested {
            for words in commands(&f.body) {
                assert_eq!(
                    words[0], "train",
                    "{name}:{}: a tested command runs train",
                    f.line
                );
                let (args, out_file) = match words.iter().position(|w| w == ">") {
                    Some(i) => (&words[1..i], words.get(i + 1)),
                    None => (&words[1..], None),
                };
                let out = train_bin_kept(&dir, &dir.join("cache"), args);
                assert!(
                    out.status.success(),
                    "{name}:{}: `{}` failed:\n{}",
                    f.line,
                    words.join(" "),
                    String::from_utf8_lossy(&out.stderr)
                );
                if let Some(file) = out_file {
                    std::fs::write(dir.join(file), &out.stdout).unwrap();
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn the_shell_words_split_as_a_shell_splits_them() {
    assert_eq!(
        commands("train --set 'a.b=\"x\"' \\\n  --devices 2   # a comment\n\n"),
        [vec!["train", "--set", "a.b=\"x\"", "--devices", "2"]]
    );
    assert_eq!(
        train_args(&words("cargo run --release --bin train -- --config c.toml")),
        Some(vec!["--config".to_string(), "c.toml".to_string()])
    );
    assert_eq!(
        key_in("[schedule.plateau]").as_deref(),
        Some("schedule.plateau")
    );
    assert_eq!(
        key_in("train.max_steps = 3").as_deref(),
        Some("train.max_steps")
    );
    assert_eq!(key_in("model.toml"), None);
    assert_eq!(anchor(" GPUs: CUDA and WGPU"), "gpus-cuda-and-wgpu");
}
