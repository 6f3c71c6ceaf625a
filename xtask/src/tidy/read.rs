//! What `tidy` reads of one file: a small Rust lexer (comments, strings, characters and
//! lifetimes told apart), the items under `#[cfg(test)]` left out, the paths, the functions.

use std::collections::BTreeSet;

/// One token of Rust source, with the line it starts on.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Tok {
    Ident(String),
    /// `::`
    Sep,
    Punct(char),
    /// A literal, a lifetime or a number: nothing the reading looks into.
    Other,
}

/// What the reading takes from one file.
#[derive(Debug, Default)]
pub(super) struct FileText {
    /// Every path that starts at `crate`, `self`, `super` or a child module, expanded.
    pub(super) paths: Vec<Vec<String>>,
    /// The file's `mod x;` children outside test code.
    pub(super) child_mods: BTreeSet<String>,
    /// `#[cfg(test)] mod x;` children: whole files of tests.
    pub(super) test_mods: BTreeSet<String>,
    /// Lines outside `#[cfg(test)]` items.
    pub(super) lines: usize,
    /// (name, first line, lines) of every function outside test code.
    pub(super) functions: Vec<(String, usize, usize)>,
    /// (line, variant) of every `StrategyKind::X` outside test code.
    pub(super) strategies: Vec<(usize, String)>,
    /// (line, name) of every identifier outside test code.
    pub(super) idents: Vec<(usize, String)>,
}

impl FileText {
    pub(super) fn read(text: &str) -> FileText {
        let toks = lex(text);
        let total = text.lines().count();
        let mut out = FileText::default();
        let mut keep = Vec::with_capacity(toks.len());
        let mut test_lines = BTreeSet::new();
        let mut i = 0;
        while i < toks.len() {
            if let Some(attr_end) = cfg_test_attr(&toks, i) {
                let end = item_end(&toks, attr_end);
                // `#[cfg(test)] mod x;` (or `pub(crate) mod x;`): the file x is all tests.
                let item: Vec<&Tok> = toks[attr_end..end].iter().map(|t| &t.0).collect();
                if let [.., Tok::Ident(m), Tok::Ident(name), Tok::Punct(';')] = item.as_slice()
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
        for w in toks.windows(3) {
            if let [
                (Tok::Ident(kind), line),
                (Tok::Sep, _),
                (Tok::Ident(name), _),
            ] = w
                && kind == "StrategyKind"
            {
                out.strategies.push((*line, name.clone()));
            }
        }
        out.idents = toks
            .iter()
            .filter_map(|(t, line)| match t {
                Tok::Ident(name) => Some((*line, name.clone())),
                _ => None,
            })
            .collect();
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
