//! `cargo xtask tidy`: the shape of `crates/kiln/src` read from its text — the import circles
//! between its files, the files past a screenful, the longest functions.
//!
//! The reading is a small Rust lexer (comments, strings, characters and lifetimes told apart),
//! not a compiler, and it is deliberately literal: a file imports the file whose module a path
//! names — `use crate::trainer::Plateau` imports `trainer/mod.rs`, wherever `Plateau` is
//! defined — so a `mod.rs` that re-exports its children and a child that takes a name back
//! through `super::` form a circle. Code under `#[cfg(test)]` is left out of everything.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use crate::Result;

/// The crate whose files the check reads, from the workspace root.
pub const KILN_SRC: &str = "crates/kiln/src";
/// A file's non-test part longer than this is listed as past a screenful.
pub const FILE_LINES: usize = 500;
/// The longest a file's non-test part may be before `tidy` fails.
pub const FILE_LIMIT: usize = 600;
/// The longest a function may be before `tidy` fails.
pub const FN_LIMIT: usize = 120;

/// What `tidy` found in one tree.
#[derive(Debug, Default)]
pub struct Shape {
    /// Each file (relative to the tree) with the files it imports.
    pub imports: BTreeMap<String, BTreeSet<String>>,
    /// Each file with the number of lines outside its `#[cfg(test)]` items.
    pub lines: BTreeMap<String, usize>,
    /// Every function outside test code: (lines, file, name, first line).
    pub functions: Vec<(usize, String, String, usize)>,
}

/// `cargo xtask tidy`: prints the circles, the long files and the five longest functions of
/// `crates/kiln/src` (functions of the whole workspace's sources), and fails on a circle, a
/// file past [`FILE_LIMIT`] or a function past [`FN_LIMIT`].
pub fn run(root: &Path, layers: bool) -> Result<()> {
    let kiln = read_tree(&root.join(KILN_SRC))?;
    if layers {
        print_layers(&kiln);
    }
    let mut functions = kiln.functions.clone();
    for other in [
        "crates/generative/src",
        "models/src",
        "datasets/src",
        "xtask/src",
    ] {
        let shape = read_tree(&root.join(other))?;
        functions.extend(
            shape
                .functions
                .into_iter()
                .map(|(n, file, name, line)| (n, format!("{other}/{file}"), name, line)),
        );
    }
    functions.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let circles = circles(&kiln.imports);
    println!(
        "import circles between the files of {KILN_SRC}: {}",
        circles.len()
    );
    for circle in &circles {
        println!(
            "  {} files; one loop: {}",
            circle.files.len(),
            circle.path.join(" -> ")
        );
        for file in &circle.files {
            let inside: Vec<&str> = kiln.imports[file]
                .iter()
                .filter(|t| circle.files.contains(t))
                .map(String::as_str)
                .collect();
            println!("    {file} imports {}", inside.join(", "));
        }
    }
    let long: Vec<_> = kiln
        .lines
        .iter()
        .filter(|(_, n)| **n > FILE_LINES)
        .collect();
    println!(
        "files of {KILN_SRC} over {FILE_LINES} lines (tests left out): {}",
        long.len()
    );
    for (file, n) in &long {
        println!("  {n:5}  {file}");
    }
    println!("the five longest functions of the workspace:");
    for (n, file, name, line) in functions.iter().take(5) {
        println!("  {n:5}  {file}:{line} {name}");
    }
    let mut faults = Vec::new();
    if !circles.is_empty() {
        faults.push(format!("{} import circle(s)", circles.len()));
    }
    let too_long = long.iter().filter(|(_, n)| **n > FILE_LIMIT).count();
    if too_long > 0 {
        faults.push(format!("{too_long} file(s) over {FILE_LIMIT} lines"));
    }
    let fn_too_long = functions.iter().filter(|f| f.0 > FN_LIMIT).count();
    if fn_too_long > 0 {
        faults.push(format!("{fn_too_long} function(s) over {FN_LIMIT} lines"));
    }
    if faults.is_empty() {
        Ok(())
    } else {
        Err(format!("tidy: {}", faults.join(", ")))
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
    println!("layers of {KILN_SRC} (a module: the modules it imports):");
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
        for (name, line, len) in file.functions {
            shape.functions.push((len, rel.clone(), name, line));
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

/// A circle of the import graph: one strongly connected component of more than one file.
#[derive(Debug, PartialEq)]
pub struct Circle {
    /// Every file of the component, sorted.
    pub files: Vec<String>,
    /// One shortest loop through its first file, that file repeated at the end.
    pub path: Vec<String>,
}

/// The circles of a graph, sorted by their first file.
pub fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Circle> {
    let nodes: Vec<&String> = graph.keys().collect();
    let index: BTreeMap<&String, usize> = nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let edges: Vec<Vec<usize>> = nodes
        .iter()
        .map(|n| {
            graph[*n]
                .iter()
                .filter_map(|t| index.get(t).copied())
                .collect()
        })
        .collect();
    let mut out = Vec::new();
    for mut component in strongly_connected(&edges) {
        if component.len() < 2 {
            continue;
        }
        component.sort();
        let inside: BTreeSet<usize> = component.iter().copied().collect();
        let start = component[0];
        let mut path: Vec<String> = shortest_cycle(start, &edges, &inside)
            .iter()
            .map(|i| nodes[*i].clone())
            .collect();
        path.push(nodes[start].clone());
        let files = component.iter().map(|i| nodes[*i].clone()).collect();
        out.push(Circle { files, path });
    }
    out.sort_by(|a, b| a.files.cmp(&b.files));
    out
}

/// Tarjan's strongly connected components, iteratively.
fn strongly_connected(edges: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let n = edges.len();
    let (mut index, mut low) = (vec![usize::MAX; n], vec![0; n]);
    let (mut on_stack, mut stack, mut out) = (vec![false; n], Vec::new(), Vec::new());
    let mut next = 0;
    for root in 0..n {
        if index[root] != usize::MAX {
            continue;
        }
        let mut work = vec![(root, 0usize)];
        while let Some(&mut (v, ref mut child)) = work.last_mut() {
            if *child == 0 {
                index[v] = next;
                low[v] = next;
                next += 1;
                stack.push(v);
                on_stack[v] = true;
            }
            if let Some(&w) = edges[v].get(*child) {
                *child += 1;
                if index[w] == usize::MAX {
                    work.push((w, 0));
                } else if on_stack[w] {
                    low[v] = low[v].min(index[w]);
                }
                continue;
            }
            work.pop();
            if let Some(&(parent, _)) = work.last() {
                low[parent] = low[parent].min(low[v]);
            }
            if low[v] == index[v] {
                let mut component = Vec::new();
                while let Some(w) = stack.pop() {
                    on_stack[w] = false;
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                out.push(component);
            }
        }
    }
    out
}

/// The shortest way from `start` back to itself inside one component (breadth first).
fn shortest_cycle(start: usize, edges: &[Vec<usize>], inside: &BTreeSet<usize>) -> Vec<usize> {
    let mut came_from = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(v) = queue.pop_front() {
        for &w in &edges[v] {
            if !inside.contains(&w) {
                continue;
            }
            if w == start {
                let mut path = vec![v];
                while let Some(&p) = came_from.get(path.last().unwrap_or(&start)) {
                    path.push(p);
                }
                path.reverse();
                return path;
            }
            if w != start && !came_from.contains_key(&w) {
                came_from.insert(w, v);
                queue.push_back(w);
            }
        }
    }
    vec![start]
}

/// One token of Rust source, with the line it starts on.
#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Sep,
    Punct(char),
    /// A literal, a lifetime or a number: nothing the reading looks into.
    Other,
}

/// What the reading takes from one file.
#[derive(Debug, Default)]
struct FileText {
    /// Every path that starts at `crate`, `self`, `super` or a child module, expanded.
    paths: Vec<Vec<String>>,
    /// The file's `mod x;` children outside test code.
    child_mods: BTreeSet<String>,
    /// `#[cfg(test)] mod x;` children: whole files of tests.
    test_mods: BTreeSet<String>,
    /// Lines outside `#[cfg(test)]` items.
    lines: usize,
    /// (name, first line, lines) of every function outside test code.
    functions: Vec<(String, usize, usize)>,
}

impl FileText {
    fn read(text: &str) -> FileText {
        let toks = lex(text);
        let total = text.lines().count();
        let mut out = FileText::default();
        let mut keep = Vec::with_capacity(toks.len());
        let mut test_lines = BTreeSet::new();
        let mut i = 0;
        while i < toks.len() {
            if let Some(attr_end) = cfg_test_attr(&toks, i) {
                let end = item_end(&toks, attr_end);
                // `#[cfg(test)] mod x;`: the file x is all tests.
                let item: Vec<&Tok> = toks[attr_end..end].iter().map(|t| &t.0).collect();
                if let [Tok::Ident(m), Tok::Ident(name), Tok::Punct(';')] = item.as_slice()
                    && m == "mod"
                {
                    out.test_mods.insert(name.clone());
                }
                let last = toks.get(end.saturating_sub(1)).map_or(toks[i].1, |t| t.1);
                test_lines.extend(toks[i].1..=last);
                i = end;
                continue;
            }
            keep.push(toks[i].clone());
            i += 1;
        }
        out.lines = total.saturating_sub(test_lines.len());
        let toks = keep;
        for w in toks.windows(3) {
            if let [
                (Tok::Ident(m), _),
                (Tok::Ident(name), _),
                (Tok::Punct(';'), _),
            ] = w
                && m == "mod"
            {
                out.child_mods.insert(name.clone());
            }
        }
        out.functions = functions(&toks);
        out.paths = paths(&toks, &out.child_mods);
        out
    }
}

/// If `#[cfg(test)]` (or a `cfg` naming `test` outside a `not`) starts at `i`, the index
/// after it.
fn cfg_test_attr(toks: &[(Tok, usize)], i: usize) -> Option<usize> {
    if toks.get(i)?.0 != Tok::Punct('#') || toks.get(i + 1)?.0 != Tok::Punct('[') {
        return None;
    }
    if toks.get(i + 2)?.0 != Tok::Ident("cfg".into()) {
        return None;
    }
    let end = matching(toks, i + 1)?;
    let inner = &toks[i + 3..end];
    let names: Vec<&str> = inner
        .iter()
        .filter_map(|t| match &t.0 {
            Tok::Ident(s) => Some(s.as_str()),
            _ => None,
        })
        .collect();
    (names == ["test"] || (names.contains(&"test") && names.first() == Some(&"all")))
        .then_some(end + 1)
}

/// The index just after the item that starts at `i` (after any further attributes): its
/// `;` at depth 0, or the `}` closing its body (and a `;` right after it).
fn item_end(toks: &[(Tok, usize)], mut i: usize) -> usize {
    while toks.get(i).is_some_and(|t| t.0 == Tok::Punct('#')) {
        match toks.get(i + 1).and_then(|_| matching(toks, i + 1)) {
            Some(end) => i = end + 1,
            None => return toks.len(),
        }
    }
    let mut depth = 0i32;
    while i < toks.len() {
        match toks[i].0 {
            Tok::Punct('(' | '[') => depth += 1,
            Tok::Punct(')' | ']') => depth -= 1,
            Tok::Punct(';') if depth == 0 => return i + 1,
            Tok::Punct('{') if depth == 0 => {
                let end = matching(toks, i).unwrap_or(toks.len() - 1);
                let after = end + 1;
                return if toks.get(after).is_some_and(|t| t.0 == Tok::Punct(';')) {
                    after + 1
                } else {
                    after
                };
            }
            _ => {}
        }
        i += 1;
    }
    toks.len()
}

/// The index of the bracket closing the one at `open`.
fn matching(toks: &[(Tok, usize)], open: usize) -> Option<usize> {
    let mut depth = 0i32;
    for (j, t) in toks.iter().enumerate().skip(open) {
        match t.0 {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => {
                depth -= 1;
                if depth == 0 {
                    return Some(j);
                }
            }
            _ => {}
        }
    }
    None
}

/// Every `fn name … { … }` with a body: (name, line of `fn`, lines to the closing brace).
fn functions(toks: &[(Tok, usize)]) -> Vec<(String, usize, usize)> {
    let mut out = Vec::new();
    for i in 0..toks.len() {
        let (Tok::Ident(kw), line) = &toks[i] else {
            continue;
        };
        let Some((Tok::Ident(name), _)) = toks.get(i + 1) else {
            continue;
        };
        if kw != "fn" {
            continue;
        }
        // The body is the first `{` outside brackets, unless a `;` ends a declaration first.
        let mut depth = 0i32;
        let mut j = i + 2;
        while j < toks.len() {
            match toks[j].0 {
                Tok::Punct('(' | '[' | '<') => depth += 1,
                Tok::Punct(')' | ']' | '>') => depth -= 1,
                Tok::Punct(';') if depth <= 0 => break,
                Tok::Punct('{') if depth <= 0 => {
                    if let Some(end) = matching(toks, j) {
                        out.push((name.clone(), *line, toks[end].1 - line + 1));
                    }
                    break;
                }
                _ => {}
            }
            j += 1;
        }
    }
    out
}

/// Every path that starts at `crate`, `self`, `super` or one of `children`, with use-trees
/// (`a::{b, c::{d}}`) expanded into one path per leaf.
fn paths(toks: &[(Tok, usize)], children: &BTreeSet<String>) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        let starts = match &toks[i].0 {
            Tok::Ident(s) => {
                matches!(s.as_str(), "crate" | "self" | "super") || children.contains(s)
            }
            _ => false,
        };
        let after_sep = i > 0 && toks[i - 1].0 == Tok::Sep;
        if starts && !after_sep && toks.get(i + 1).is_some_and(|t| t.0 == Tok::Sep) {
            let mut found = Vec::new();
            i = use_tree(toks, i, Vec::new(), &mut found);
            out.extend(found);
        } else {
            i += 1;
        }
    }
    out
}

/// Reads a path or use-tree from `i` under `prefix`; returns the index after it.
fn use_tree(
    toks: &[(Tok, usize)],
    mut i: usize,
    mut prefix: Vec<String>,
    out: &mut Vec<Vec<String>>,
) -> usize {
    loop {
        match toks.get(i).map(|t| &t.0) {
            Some(Tok::Ident(s)) => {
                prefix.push(s.clone());
                i += 1;
            }
            Some(Tok::Punct('{')) => {
                i += 1;
                loop {
                    match toks.get(i).map(|t| &t.0) {
                        Some(Tok::Punct('}')) | None => return i + 1,
                        Some(Tok::Punct(',')) => i += 1,
                        Some(Tok::Ident(_)) => i = use_tree(toks, i, prefix.clone(), out),
                        _ => i += 1,
                    }
                }
            }
            _ => {
                out.push(prefix);
                return i;
            }
        }
        if toks.get(i).is_some_and(|t| t.0 == Tok::Sep) {
            i += 1;
        } else {
            // `as alias` and anything else end the path.
            if toks.get(i).is_some_and(|t| t.0 == Tok::Ident("as".into())) {
                i += 2;
            }
            out.push(prefix);
            return i;
        }
    }
}

/// Rust source as tokens: comments dropped; string, character and number literals and
/// lifetimes as [`Tok::Other`].
fn lex(text: &str) -> Vec<(Tok, usize)> {
    let c: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    let ident_start = |ch: char| ch.is_alphabetic() || ch == '_';
    let ident_char = |ch: char| ch.is_alphanumeric() || ch == '_';
    while i < c.len() {
        let ch = c[i];
        let next = c.get(i + 1).copied();
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && next == Some('*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    line += usize::from(c[i] == '\n');
                    i += 1;
                }
            }
        } else if let Some(end) = raw_string(&c, i) {
            line += c[i..end].iter().filter(|ch| **ch == '\n').count();
            out.push((Tok::Other, line));
            i = end;
        } else if ch == '"' || (matches!(ch, 'b' | 'c') && next == Some('"')) {
            let start_line = line;
            i += if ch == '"' { 1 } else { 2 };
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' {
                    i += 1;
                }
                line += usize::from(c.get(i) == Some(&'\n'));
                i += 1;
            }
            i += 1;
            out.push((Tok::Other, start_line));
        } else if ch == '\'' || (ch == 'b' && next == Some('\'')) {
            let j = if ch == 'b' { i + 1 } else { i };
            if c.get(j + 1) == Some(&'\\') {
                // An escaped character: to the closing quote.
                let mut k = j + 2;
                while k < c.len() && c[k] != '\'' {
                    k += 1;
                }
                i = k + 1;
            } else if c.get(j + 2) == Some(&'\'') {
                i = j + 3;
            } else {
                // A lifetime or a label.
                i = j + 1;
                while i < c.len() && ident_char(c[i]) {
                    i += 1;
                }
            }
            out.push((Tok::Other, line));
        } else if ch.is_ascii_digit() {
            while i < c.len()
                && (ident_char(c[i])
                    || (c[i] == '.' && c.get(i + 1).is_some_and(|d| d.is_ascii_digit())))
            {
                i += 1;
            }
            out.push((Tok::Other, line));
        } else if ident_start(ch) {
            if ch == 'r' && next == Some('#') && c.get(i + 2).is_some_and(|d| ident_start(*d)) {
                i += 2;
            }
            let start = i;
            while i < c.len() && ident_char(c[i]) {
                i += 1;
            }
            out.push((Tok::Ident(c[start..i].iter().collect()), line));
        } else if ch == ':' && next == Some(':') {
            out.push((Tok::Sep, line));
            i += 2;
        } else if ch == '-' && next == Some('>') {
            // `->` is not a closing angle bracket.
            out.push((Tok::Other, line));
            i += 2;
        } else if ch == '=' && next == Some('>') {
            out.push((Tok::Other, line));
            i += 2;
        } else {
            out.push((Tok::Punct(ch), line));
            i += 1;
        }
    }
    out
}

/// If a raw string (`r"…"`, `r#"…"#`, `br"…"`, `cr"…"`) starts at `i`, the index after it.
fn raw_string(c: &[char], i: usize) -> Option<usize> {
    let mut j = i;
    if matches!(c.get(j), Some('b' | 'c')) {
        j += 1;
    }
    if c.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let mut hashes = 0;
    while c.get(j) == Some(&'#') {
        hashes += 1;
        j += 1;
    }
    if c.get(j) != Some(&'"') {
        return None;
    }
    j += 1;
    while j < c.len() {
        if c[j] == '"' && (1..=hashes).all(|h| c.get(j + h) == Some(&'#')) {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    Some(c.len())
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
        assert_eq!(f.test_mods, BTreeSet::from(["tests_file".to_string()]));
        assert_eq!(f.functions, vec![("long".to_string(), 10, 5)]);
        assert_eq!(f.lines, text.lines().count() - 2 - 5);
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

    /// The check the project holds itself to: no circle between the files of the kiln crate,
    /// no file past the limit, no function past the limit.
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
